"""Host-side collectives: one small interface, one implementation per engine.

A strategy holds one (`Strategy.collectives`); the rest of keras_dist reaches it through
the strategy (`strategy.sum_arrays(...)`). Each call is a collective: every process of
the job makes the same calls in the same order. This class is also the single-process
case: each public method answers for one process itself, so an engine implements only
the underscored methods, for a job of several.

Engines: `horovod` (Horovod's TensorFlow and torch operations), `tf_distribute` (a
`tf.distribute` strategy's all-reduce, for MultiWorkerMirrored), `jax_processes` (JAX's
multi-host utilities) and `torch_distributed` (`torch.distributed`).
"""

from __future__ import annotations

import pickle
from typing import Any, Sequence

import numpy as np

# After a collective failed, how long each process waits for the others to say they saw
# it fail too: those that do not are the ones that stopped (their machine frozen or gone).
PEERS_SECONDS = 3.0


class Collectives:
    """Sum, mean, broadcast, all-gather (of arrays and of objects) and barrier over a job's processes.

    An engine that cannot gather objects itself implements `_stack` (every process's
    array of one shape, stacked in rank order); objects then travel as pickled bytes,
    padded to a power of two (JAX compiles one computation per shape).
    """

    name = "single"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    # --- the interface ---------------------------------------------------------------
    def sum_arrays(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Each NumPy array summed over processes (same shapes on every process), dtypes kept."""
        arrays = [np.asarray(a) for a in arrays]
        return self._sum_arrays(arrays) if arrays and self.size > 1 else arrays

    def mean_arrays(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Each array averaged over processes, in float64."""
        return [np.asarray(s, np.float64) / self.size for s in self.sum_arrays([np.asarray(a, np.float64) for a in arrays])]

    def allgather_object(self, obj: Any) -> list:
        """Every process's `obj` (picklable), in rank order, on every process."""
        return self._allgather_object(obj) if self.size > 1 else [obj]

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        """`root`'s `obj` on every process."""
        return self._broadcast_object(obj, root) if self.size > 1 else obj

    def allgather_array(self, array: Any) -> np.ndarray:
        """NumPy arrays of possibly different lengths concatenated in rank order."""
        return self._allgather_array(np.asarray(array)) if self.size > 1 else np.asarray(array)

    def broadcast_variables(self, variables: Sequence[Any], root: int = 0) -> None:
        """Overwrites Keras `variables` on every process with their values on `root`."""
        if self.size > 1 and variables:
            self._broadcast_variables(list(variables), root)

    def barrier(self) -> None:
        """Returns once every process has called it."""
        if self.size > 1:
            self._barrier()

    # --- what an engine implements (defaults built on `_stack`) ------------------------
    def _stack(self, array: np.ndarray) -> np.ndarray:
        """Every process's `array` (the same shape and dtype everywhere), stacked in rank order."""
        raise NotImplementedError

    def _allgather_object(self, obj: Any) -> list:
        data = pickle.dumps(obj)
        lengths = self._stack(np.array([len(data)], np.int64))[:, 0]
        padded = np.zeros(max(256, 1 << (int(lengths.max()) - 1).bit_length()), np.uint8)
        padded[:len(data)] = np.frombuffer(data, np.uint8)
        rows = self._stack(padded)
        return [pickle.loads(rows[rank, :length].tobytes()) for rank, length in enumerate(lengths)]

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        return self._allgather_object(obj if self.rank == root else None)[root]

    def _sum_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        # Exact whatever the dtype: every process's arrays, summed here in NumPy.
        parts = self._allgather_object(arrays)
        return [np.sum([p[i] for p in parts], axis=0).astype(a.dtype) for i, a in enumerate(arrays)]

    def _allgather_array(self, array: np.ndarray) -> np.ndarray:
        return np.concatenate(self._allgather_object(array))

    def _broadcast_variables(self, variables: list, root: int) -> None:
        import keras

        values = self._broadcast_object([keras.ops.convert_to_numpy(v.value) for v in variables], root)
        for variable, value in zip(variables, values):
            variable.assign(value)

    def _barrier(self) -> None:
        self._stack(np.zeros(1, np.int32))

    def describe(self) -> dict:
        return {"collectives": self.name}


SINGLE = Collectives()


def flatten(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """`arrays` as one float64 vector: one collective carries them all (`unflatten` splits it)."""
    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])


def unflatten(flat: np.ndarray, like: Sequence[np.ndarray]) -> list[np.ndarray]:
    """`flat` split into arrays of the shapes and dtypes of `like`."""
    ends = np.cumsum([a.size for a in like])[:-1]
    return [part.reshape(a.shape).astype(a.dtype) for part, a in zip(np.split(flat, ends), like)]
