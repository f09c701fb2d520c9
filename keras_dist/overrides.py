"""Per-instance replacements of Keras methods, recorded so that a later compile starts afresh.

keras_dist never patches a Keras class: it replaces methods on one model, optimizer or
layer object. Each replacement is recorded on the object, and `restore` removes them
all, so compiling a model again (freeze, compile, fit; unfreeze, compile, fit) wraps
Keras's own methods once more instead of wrapping the previous wrappers.
"""

import contextlib
from collections.abc import Iterator
from typing import Any

_RECORD = "_keras_dist_overrides"


def override(obj: object, name: str, value: Any) -> None:
    """Sets `obj.<name> = value` on this instance only and records it.

    `object.__setattr__` bypasses Keras's attribute tracking: a method is not state.
    """
    object.__setattr__(obj, name, value)
    obj.__dict__.setdefault(_RECORD, set()).add(name)


def is_overridden(obj: object, name: str) -> bool:
    """Whether `override` replaced `obj.<name>` since the last `restore`."""
    return name in obj.__dict__.get(_RECORD, ())


def restore(obj: object) -> None:
    """Removes every `override` of `obj`: its attributes are its class's again."""
    for name in obj.__dict__.pop(_RECORD, ()):
        obj.__dict__.pop(name, None)


@contextlib.contextmanager
def set_while(obj: object, name: str, value: Any) -> Iterator[None]:
    """Sets `obj.<name> = value` for the duration of a `with` block, then puts the old value back."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)


@contextlib.contextmanager
def methods_while(obj: object, methods: dict[str, Any]) -> Iterator[None]:
    """Replaces methods on the instance `obj` for the duration of a `with` block (bypassing
    Keras's attribute tracking), then puts back what the instance had."""
    previous = {name: vars(obj).get(name) for name in methods}
    for name, method in methods.items():
        object.__setattr__(obj, name, method)
    try:
        yield
    finally:
        for name, method in previous.items():
            if method is None:
                vars(obj).pop(name, None)
            else:
                object.__setattr__(obj, name, method)
