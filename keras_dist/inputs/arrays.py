"""Arrays: the interleaved split of any structure of arrays Keras takes, and its inverse for outputs.

Element i goes to shard i mod N. With shuffling off, shard r at batch B then sees, at step
k, exactly the elements of global batch k of one process at batch N*B, so N replicas at
batch B compute the same updates as one process at N*B.

"Arrays" are what Keras's array adapter slices (NumPy, `tf.Tensor` including sparse and
ragged, JAX and torch tensors, pandas DataFrames and Series, scipy sparse matrices),
alone or nested in lists, tuples and dicts. Every rule here maps over the whole structure
(`keras.tree`) and slices each leaf with Keras's own slicing, so a leaf keeps its type.
"""

from typing import TYPE_CHECKING, Any

import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy


def _array_slicing():
    # Keras's private module, where its array adapter and `validation_split` slice: using it
    # keeps every leaf type Keras takes. Imported on use, as it pulls in the adapters.
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing


def _leaves(data: Any) -> list:
    return [a for a in tree.flatten(data) if a is not None]


def is_array_input(data: Any) -> bool:
    """Whether `data` is one array, or a structure of them, that Keras's array adapter slices."""
    leaves = _leaves(data)
    return bool(leaves) and all(_array_slicing().can_slice_array(a) for a in leaves)


def num_samples(data: Any) -> int:
    """The length of the first dimension shared by every leaf of `data`."""
    lengths = {int(a.shape[0]) for a in _leaves(data)}
    if len(lengths) != 1:
        raise KerasDistError(f"x, y and sample_weight must have the same number of samples, got lengths "
                             f"{sorted(lengths)}; check their first dimensions")
    return lengths.pop()


def take_rows(data: Any, rows: np.ndarray) -> Any:
    """`data` with every leaf cut to `rows` of its first dimension (None leaves kept)."""
    sliceables = _array_slicing().convert_to_sliceable(data)
    return tree.map_structure(lambda s: None if s is None else s[rows], sliceables)


def for_tf_data(data: Any) -> Any:
    """`data` as `tf.data.Dataset.from_tensor_slices` takes it, as Keras's adapter gives it: each
    leaf a TensorFlow-compatible array, each list a tuple (a list would be one stacked tensor)."""
    return tree.lists_to_tuples(_array_slicing().convert_to_sliceable(data, target_backend="tensorflow"))


def hold_out(data: Any, fraction: float) -> tuple[Any, Any]:
    """Keras's `validation_split` of a structure `(x, y, sample_weight)`: (kept, the last `fraction`)."""
    return _array_slicing().train_validation_split(data, validation_split=fraction)


def shard_rows(length: int, num_shards: int, index: int, pad: bool) -> np.ndarray:
    """The rows of shard `index`: `index`, `index + N`, ...; padded, every shard gets ceil(length / N)
    rows, the missing ones taken again from the start."""
    end = length + (-length) % num_shards if pad else length
    return np.arange(index, end, num_shards) % max(length, 1)


def shard_arrays(data: Any, num_shards: int, index: int, pad: bool) -> Any:
    """Shard `index` of a structure of equally long arrays (None leaves kept)."""
    if not _leaves(data):
        return data
    length = num_samples(data)
    if length == 0 and num_shards > 1:
        raise KerasDistError("x has no samples; pass a non-empty input")
    return take_rows(data, shard_rows(length, num_shards, index, pad))


def allgather_parts(backend: "Strategy", leaf: Any) -> list[np.ndarray]:
    """Every process's `leaf` (first dimensions may differ), in rank order."""
    counts = backend.allgather_object(len(leaf))
    stacked = backend.allgather_array(np.asarray(leaf))
    return np.split(stacked, np.cumsum(counts)[:-1])


def gather_interleaved(backend: "Strategy", local_outputs: Any, num_shards: int, length: int | None = None) -> Any:
    """Inverse of the interleaved split: every process gets the whole result.

    Shards may differ in length (unpadded). With `length`, the rows past it (the padding
    of padded shards) are dropped.
    """

    def gather(leaf):
        parts = allgather_parts(backend, leaf)
        out = np.empty((sum(len(p) for p in parts),) + parts[0].shape[1:], dtype=parts[0].dtype)
        for rank, part in enumerate(parts):
            out[rank::num_shards][:len(part)] = part
        return out if length is None else out[:length]

    return tree.map_structure(gather, local_outputs)
