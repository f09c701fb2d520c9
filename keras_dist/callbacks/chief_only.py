"""Keep callbacks that write files from running on workers other than the chief."""

from collections.abc import Iterable
from typing import TYPE_CHECKING

import keras

from keras_dist.fault_tolerance.atomic_writes import make_writes_atomic

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy

# Callbacks that write under a user-given path. A user subclass of one counts too.
FILE_WRITING_CALLBACKS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
)


def callbacks_for_this_worker(callbacks: Iterable[keras.callbacks.Callback] | keras.callbacks.CallbackList | None,
                              strategy: "Strategy") -> list[keras.callbacks.Callback]:
    """The user's callbacks as this worker must run them.

    Args:
        callbacks: a list of callbacks, a `keras.callbacks.CallbackList`, or None.
        strategy: the active keras_dist strategy.

    Returns:
        A new list. On the chief, every callback, checkpoints written atomically
        (`make_writes_atomic`). On other workers, file-writing callbacks are dropped,
        or, where the strategy's saves are collective (every worker must take part in
        a save), replaced by the strategy's stand-in (`Strategy.worker_file_callback`).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    callbacks = list(callbacks or [])
    if strategy.is_chief:
        return [strategy.chief_file_callback(make_writes_atomic(c)) if isinstance(c, FILE_WRITING_CALLBACKS) else c
                for c in callbacks]
    kept = [strategy.worker_file_callback(c) if isinstance(c, FILE_WRITING_CALLBACKS) else c for c in callbacks]
    return [c for c in kept if c is not None]
