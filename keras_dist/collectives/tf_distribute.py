"""A `tf.distribute` strategy's all-reduce (MultiWorkerMirrored's collective ops), eagerly."""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_dist.collectives import Collectives, flatten, unflatten


class TFDistribute(Collectives):
    """Everything through one operation, the strategy's SUM all-reduce of one array (each
    process's first replica contributes it, the others zeros)."""

    name = "tf.distribute"

    def __init__(self, strategy: Any, rank: int, size: int):
        self._strategy = strategy
        self._rank, self._size = rank, size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def _sum(self, array: np.ndarray) -> np.ndarray:
        import tensorflow as tf

        local = self._strategy.num_replicas_in_sync // self._size
        value = tf.convert_to_tensor(array)
        values = self._strategy.experimental_distribute_values_from_function(
            lambda ctx: value if ctx.replica_id_in_sync_group % local == 0 else tf.zeros_like(value)
        )
        return self._strategy.reduce(tf.distribute.ReduceOp.SUM, values, axis=None).numpy()

    def _stack(self, array: np.ndarray) -> np.ndarray:
        if array.dtype == np.uint8 and array.size % 8 == 0:  # pickled objects: 8 bytes a word
            words = self._stack(array.reshape(-1).view(np.int64))
            return words.view(np.uint8).reshape((self._size,) + array.shape)
        # Each process fills its own row (the others' are zeros, so the sum is exact); other
        # types travel as int64 or float64, which the collective ops reduce.
        wire = np.float64 if np.issubdtype(array.dtype, np.floating) else np.int64
        rows = np.zeros((self._size,) + array.shape, wire)
        rows[self._rank] = array
        return self._sum(rows).astype(array.dtype)

    def _allgather_array(self, array: np.ndarray) -> np.ndarray:
        # In the array's own dtype (bool as uint8), not pickled: predictions can be large.
        wire = array.astype(np.uint8) if array.dtype == bool else array
        lengths = self._stack(np.array([len(array)], np.int64))[:, 0]
        rows = np.zeros((self._size, int(lengths.max())) + array.shape[1:], wire.dtype)
        rows[self._rank, :len(array)] = wire
        summed = self._sum(rows)
        return np.concatenate([summed[rank, :length] for rank, length in enumerate(lengths)]).astype(array.dtype)

    def _sum_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        return unflatten(self._sum(flatten(arrays)), arrays)

    def _broadcast_variables(self, variables: list, root: int) -> None:
        for variable in variables:
            value = np.asarray(variable.numpy())
            variable.assign(self._sum(value if self._rank == root else np.zeros_like(value)))

    def _barrier(self) -> None:
        self._sum(np.zeros(1, np.int32))
