"""What keras_dist notices as TensorFlow creates a variable, through one creator scope per process.

TensorFlow calls the thread's variable creators (`tf.variable_creator_scope`) for every
variable it creates, inside `tf.function` too. keras_dist enters one scope, once, and never
leaves it; the parts that watch variable creation (`compiled_elsewhere`, a compile keras_dist
did not run; `fault_tolerance.tf_checkpoints`, a checkpoint's first save) add a watcher to
it. Two scopes entered apart would be closed out of order when the process ends, which
TensorFlow reports as an error.
"""

from collections.abc import Callable
from typing import Any

_WATCHERS: list[Callable[[], None]] = []
_ENTERED: list[Any] = []


def watch(watcher: Callable[[], None]) -> None:
    """Calls `watcher()` before TensorFlow creates each variable, from now on (once per `watcher`)."""
    if watcher in _WATCHERS:
        return
    _WATCHERS.append(watcher)
    if _ENTERED:
        return
    import tensorflow as tf

    def creator(next_creator, **kwargs):
        for each in _WATCHERS:
            each()
        return next_creator(**kwargs)

    scope = tf.variable_creator_scope(creator)
    scope.__enter__()
    _ENTERED.append(scope)
