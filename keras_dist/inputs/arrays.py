"""Arrays (NumPy, or anything with `__array__`): the interleaved split, and its inverse for outputs.

Element i goes to shard i mod N. With shuffling off, shard r at batch B then sees, at step
k, exactly the elements of global batch k of one process at batch N*B, so N replicas at
batch B compute the same updates as one process at N*B.
"""

from typing import TYPE_CHECKING, Any

import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy


def is_array_input(data: Any) -> bool:
    leaves = tree.flatten(data)
    return bool(leaves) and all(hasattr(a, "__array__") for a in leaves)  # NumPy, tf.Tensor, jax.Array...


def shard_arrays(data: Any, num_shards: int, index: int, pad: bool) -> Any:
    """Shard `index` of a nested structure of equally long arrays (None leaves kept)."""
    leaves = [a for a in tree.flatten(data) if a is not None]
    if not leaves:
        return data
    length = len(leaves[0])
    if any(len(a) != length for a in leaves):
        raise KerasDistError("x, y and sample_weight must have the same number of samples; check their first dimensions")
    if length == 0 and num_shards > 1:
        raise KerasDistError("x has no samples; pass a non-empty input")
    if pad and length % num_shards:
        order = np.arange(length + (-length) % num_shards) % length
        return tree.map_structure(lambda a: None if a is None else np.asarray(a)[order[index::num_shards]], data)
    return tree.map_structure(lambda a: None if a is None else a[index::num_shards], data)


def gather_interleaved(backend: "Strategy", local_outputs: Any, num_shards: int) -> Any:
    """Inverse of the unpadded interleaved split: every process gets the full result."""

    def gather(leaf):
        parts = backend.allgather_object(len(leaf))
        stacked = backend.allgather_array(np.asarray(leaf))
        out = np.empty((sum(parts),) + stacked.shape[1:], dtype=stacked.dtype)
        start = 0
        for rank, count in enumerate(parts):
            out[rank::num_shards][:count] = stacked[start:start + count]
            start += count
        return out

    return tree.map_structure(gather, local_outputs)
