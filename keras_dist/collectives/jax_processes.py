"""JAX's multi-host utilities (`jax.experimental.multihost_utils`) over the job's processes."""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_dist.collectives import Collectives


class JaxProcesses(Collectives):
    """Gathers through `process_allgather`, as raw bytes: JAX would narrow 64-bit values
    without x64, and every new shape compiles a new computation (objects travel padded
    to a power of two)."""

    name = "jax"

    def __init__(self, jax: Any):
        self._jax = jax

    @property
    def rank(self) -> int:
        return self._jax.process_index()

    @property
    def size(self) -> int:
        return self._jax.process_count()

    def _stack(self, array: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils

        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        rows = np.asarray(multihost_utils.process_allgather(raw)).reshape(self.size, -1)
        return rows.view(array.dtype).reshape((self.size,) + array.shape)

    def _broadcast_variables(self, variables: list, root: int) -> None:
        import keras
        from jax.experimental import multihost_utils

        values = [keras.ops.convert_to_numpy(v.value) for v in variables]
        for variable, value in zip(variables, multihost_utils.broadcast_one_to_all(values, is_source=self.rank == root)):
            variable.assign(np.asarray(value))

    def _barrier(self) -> None:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("keras_dist.barrier")
