"""The process-wide strategy (the *backend* a user picks by name): chosen once, by `init`, shared by everything else."""

from typing import TYPE_CHECKING, Any

from keras_dist import console, strategies
from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy

_current = None


def init(backend: str | None = None, **options: Any) -> "Strategy":
    """Starts keras_dist in this process and returns the active strategy.

    Calling it is optional: `keras_dist.compile` calls it. Call it yourself to pick a
    backend explicitly or to read the topology before building the model.

    Args:
        backend: a backend name (see `keras_dist.strategies.REGISTRY`); default: the
            `KERAS_DIST_BACKEND` environment variable, else the launcher detected.
        **options: backend options, e.g. `tpu="my-tpu"` for the `tpu` backend.

    Returns:
        The strategy, with `name`, `rank`, `size`, `local_rank`, `is_chief` and
        `num_replicas`.

    Example:

    ```python
    ctx = keras_dist.init()
    print(ctx.name, ctx.rank, ctx.size, ctx.is_chief)
    ```
    """
    global _current
    name, _ = strategies.select(backend)
    if _current is not None:
        if backend and backend != _current.name:
            raise KerasDistError(
                f"keras_dist already runs the {_current.name!r} backend; call "
                f"keras_dist.init(backend={backend!r}) before anything else uses keras_dist"
            )
        return _current
    _current = strategies.create(name, **options)
    console.announce(_current)
    return _current


def current() -> "Strategy":
    """The active strategy, starting the default one if `init` was not called."""
    return _current if _current is not None else init()
