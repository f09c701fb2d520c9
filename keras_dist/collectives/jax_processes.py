"""JAX's multi-host utilities (`jax.experimental.multihost_utils`) over the job's processes."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_dist.collectives import Collectives


class JaxProcesses(Collectives):
    """Gathers through `process_allgather`, as raw bytes: JAX would narrow 64-bit values
    without x64, and every new shape compiles a new computation (objects travel padded
    to a power of two).

    Args:
        jax: the `jax` module.
        timed: a context each collective runs in: JAX's collectives wait for ever, so the
            strategy times them (`PeerWatch.in_collective`).
    """

    name = "jax"

    def __init__(self, jax: Any, timed: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self._jax = jax
        self._timed = timed

    @property
    def rank(self) -> int:
        return self._jax.process_index()

    @property
    def size(self) -> int:
        return self._jax.process_count()

    def _stack(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        with self._timed():
            rows = np.asarray(multihost_utils.process_allgather(raw)).reshape(self.size, -1)
        return rows.view(array.dtype).reshape((self.size,) + array.shape)

    def _broadcast_variables(self, variables: list, root: int) -> None:
        import keras
        from jax.experimental import multihost_utils

        values = [keras.ops.convert_to_numpy(v.value) for v in variables]
        with self._timed():
            values = [np.asarray(v) for v in multihost_utils.broadcast_one_to_all(values, is_source=self.rank == root)]
        for variable, value in zip(variables, values):
            variable.assign(value)

    def broadcast_array(self, array: np.ndarray, root: int = 0) -> np.ndarray:
        """`array` as `root` holds it, on every process (each passes one of its shape and dtype)."""
        from jax.experimental import multihost_utils

        with self._timed():
            return np.asarray(multihost_utils.broadcast_one_to_all(array, is_source=self.rank == root))

    def _barrier(self) -> None:
        from jax.experimental import multihost_utils

        with self._timed():
            multihost_utils.sync_global_devices("keras_dist.barrier")
