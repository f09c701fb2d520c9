"""Horovod: its TensorFlow operations (`horovod.tensorflow`) and its torch ones (`horovod.torch`)."""

from __future__ import annotations

import contextlib
import itertools
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from keras_dist.collectives import Collectives
from keras_dist.collectives.torch_distributed import TorchTensors

# Horovod 0.28 has no bfloat16 collectives: gradient_compression="bf16" is refused with this.
NO_BFLOAT16 = "Horovod all-reduces no bfloat16; use gradient_compression='fp16' under horovodrun"


# Horovod's own `allgather_object` and `broadcast_object` turn the pickled bytes into a
# tensor one element at a time (`bytearray` into `tf.convert_to_tensor` or `torch.ByteTensor`),
# many times the bytes in memory and time (bench/results/2026-11-29-cpu-2core-restore-memory.md).
# Both fronts here send the pickled bytes as one uint8 array instead.


def _pickled(obj: Any) -> bytearray:
    return bytearray(pickle.dumps(obj))


def _unpickled_parts(gathered: np.ndarray, lengths: Any) -> list:
    """Each process's object from the bytes an all-gather concatenated in rank order."""
    ends = np.cumsum(np.asarray(lengths, np.int64))
    return [pickle.loads(gathered[end - length:end].tobytes()) for end, length in zip(ends, lengths)]


class _Horovod:
    """Ranks as Horovod numbers them (`self._hvd`: its TensorFlow or torch front)."""

    _hvd: Any

    @property
    def rank(self) -> int:
        return self._hvd.rank()

    @property
    def size(self) -> int:
        return self._hvd.size()


class HorovodTensorFlow(_Horovod, Collectives):
    """Horovod's TensorFlow operations. Every eager call gets the next name of one sequence,
    the same on every process; Horovod 0.28 matches eager operations by kind and order
    whatever their names (`allreduce(name="a")` on one process met `name="b"` on the
    other), so the sequence is what keeps every process's calls in step.

    Args:
        hvd: `horovod.tensorflow`, initialized.
        peer_failure: the one-line account of an operation's error where it means a peer
            stopped (the strategy's, which knows the job's store), or None for any other error.
    """

    name = "horovod"

    def __init__(self, hvd: Any, peer_failure: Callable[[Exception], Exception | None] = lambda error: None):
        self._hvd = hvd
        self._names = itertools.count()
        self._peer_failure = peer_failure

    def _name(self, kind: str) -> str:
        return f"keras_dist.{kind}.{next(self._names)}"

    @contextlib.contextmanager
    def _peers_answer(self) -> Iterator[None]:
        """An eager operation outside fit (a save's gather, a seed's broadcast) whose peer
        stopped or never came ends in the strategy's one line, as a step's does."""
        try:
            yield
        except Exception as error:
            failure = self._peer_failure(error)
            if failure is None:
                raise
            raise failure from None

    def _allgather_object(self, obj: Any) -> list:
        data = np.frombuffer(_pickled(obj), np.uint8)
        with self._peers_answer():
            lengths = self._hvd.allgather(np.array([data.size], np.int64), name=self._name("allgather_object")).numpy()
            gathered = self._hvd.allgather(data, name=self._name("allgather_object")).numpy()
        return _unpickled_parts(gathered, lengths.tolist())

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        data = np.frombuffer(_pickled(obj), np.uint8) if self.rank == root else None
        with self._peers_answer():
            length = self._hvd.broadcast(np.array([0 if data is None else data.size], np.int64), root_rank=root,
                                         name=self._name("broadcast_object")).numpy()
            received = self._hvd.broadcast(np.zeros(int(length[0]), np.uint8) if data is None else data,
                                           root_rank=root, name=self._name("broadcast_object"))
        return obj if self.rank == root else pickle.loads(received.numpy().tobytes())

    def _broadcast_variables(self, variables: list, root: int) -> None:
        with self._peers_answer():
            for variable in variables:
                variable.assign(self._hvd.broadcast(variable.value, root_rank=root, name=self._name("broadcast")))

    def _sum_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        import tensorflow as tf

        with self._peers_answer():
            summed = self._hvd.grouped_allreduce([tf.convert_to_tensor(a) for a in arrays], op=self._hvd.Sum,
                                                 name=self._name("sum_arrays"))
        return [s.numpy() for s in summed]

    # --- inside the train step (traced into its graph) --------------------------
    def reduce_in_step(self, tensors: list, mean: bool = False, compression: str | None = None,
                       name: str | None = None) -> list:
        """One grouped all-reduce of `tensors` (sum, or mean over processes), optionally sent
        as float16. Unnamed, Horovod names it after the graph's operations, the same on
        every process where every process builds the same graph; `name`: the same on every
        process, wherever the operation is in the graph."""
        hvd = self._hvd
        wire = hvd.Compression.fp16 if compression == "fp16" else hvd.Compression.none
        return hvd.grouped_allreduce(list(tensors), op=hvd.Average if mean else hvd.Sum, compression=wire,
                                     **({} if name is None else {"name": name, "ignore_name_scope": True}))

    def broadcast_in_step(self, tensor: Any, root: int, name: str) -> Any:
        """`tensor` as process `root` holds it, on every process (`name`: the same on every
        process, wherever the operation is in the graph)."""
        return self._hvd.broadcast(tensor, root_rank=root, name=name, ignore_name_scope=True)

    def all_in_step(self, flag: Any) -> Any:
        """Whether `flag` (a boolean tensor) holds on every process."""
        import tensorflow as tf

        return self._hvd.allreduce(tf.cast(flag, tf.int32), op=self._hvd.Min) > 0

    def _allgather_array(self, array: np.ndarray) -> np.ndarray:
        with self._peers_answer():
            return self._hvd.allgather(array, name=self._name("allgather")).numpy()

    def _barrier(self) -> None:
        import tensorflow as tf

        with self._peers_answer():
            self._hvd.allreduce(tf.zeros([1]), name=self._name("barrier"))


class HorovodTorch(_Horovod, TorchTensors):
    """Horovod's torch operations: Gloo, MPI or NCCL, as Horovod was built."""

    name = "horovod"

    def __init__(self, torch: Any, hvd: Any):
        self._hvd = hvd
        hvd.init()
        self.device = torch.device("cuda" if torch.cuda.is_available() and hvd.nccl_built() else "cpu")

    def start_sum(self, tensor: Any, name: str) -> Any:
        # A name stable across steps lets Horovod's response cache skip the coordinator's
        # negotiation; an unnamed operation gets a new name, and a full negotiation, each time.
        return self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum)

    def wait(self, handle: Any, tensor: Any) -> Any:
        return self._hvd.synchronize(handle)

    def min(self, tensor: Any) -> Any:
        return self._hvd.allreduce(tensor, op=self._hvd.Min)

    def broadcast_(self, tensor: Any, root: int) -> None:
        self._hvd.broadcast_(tensor, root_rank=root)

    def all_gather_(self, out: Any, part: Any, name: str) -> None:
        out.copy_(self._hvd.allgather(part, name=name))

    def reduce_scatter_(self, out: Any, whole: Any, name: str) -> None:
        out.copy_(self._hvd.reducescatter(whole, name=name, op=self._hvd.Sum))

    # Named: Horovod's default name is the object's type, and processes that pass objects
    # of different types (the chief's seed, the others' None) would wait for each other forever.
    def _allgather_object(self, obj: Any) -> list:
        import torch

        data = torch.frombuffer(_pickled(obj), dtype=torch.uint8)
        lengths = self._hvd.allgather(torch.tensor([data.numel()]), name="keras_dist.allgather_object.lengths")
        gathered = self._hvd.allgather(data, name="keras_dist.allgather_object")
        return _unpickled_parts(gathered.numpy(), lengths.tolist())

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        import torch

        data = torch.frombuffer(_pickled(obj), dtype=torch.uint8) if self.rank == root else None
        length = torch.tensor([0 if data is None else data.numel()])
        self._hvd.broadcast_(length, root_rank=root, name="keras_dist.broadcast_object.length")
        if data is None:
            data = torch.empty(int(length[0]), dtype=torch.uint8)
        self._hvd.broadcast_(data, root_rank=root, name="keras_dist.broadcast_object")
        return obj if self.rank == root else pickle.loads(data.numpy().tobytes())

    def _barrier(self) -> None:
        self._hvd.barrier()
