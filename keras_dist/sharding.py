"""Input sharding that needs no framework: arrays, `keras.utils.PyDataset`, gathering outputs.

Arrays are split interleaved: element i goes to shard i mod N. With shuffling off, shard
r at batch B then sees, at step k, exactly the elements of global batch k of one process
at batch N*B, so N replicas at batch B compute the same updates as one process at N*B.
`tf.data` pipelines are split inside their graph by `keras_dist.tf_data_sharding`, which
alone imports TensorFlow.
"""

import sys

import keras
import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError


def is_tf_dataset(data):
    """Whether `data` is a `tf.data.Dataset` (without importing TensorFlow: none exists before it is)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def is_data_loader(data):
    """Whether `data` is a `torch.utils.data.DataLoader` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.utils.data.DataLoader)


def is_array_input(data):
    leaves = tree.flatten(data)
    return bool(leaves) and all(hasattr(a, "__array__") for a in leaves)  # NumPy, tf.Tensor, jax.Array...


def shard_arrays(data, num_shards, index, pad):
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


class ShardedPyDataset(keras.utils.PyDataset):
    """One process's share of a `keras.utils.PyDataset`, split by batch index.

    Global step s takes the script's batches s*U ... s*U + U - 1, U = num_shards *
    batch_multiplier (one per replica), so N replicas at batch B see what one process at
    N*B does. This process concatenates its `batch_multiplier` batches of each step.
    With `equal_steps` every shard has the same number of steps: a training shard that
    runs short takes batches from the start again (fewer than U in all); otherwise it
    gets empty batches (where steps are collective, the strategy's step skips them).
    Without, a shard ends after its last batch of its own: an empty batch would put NaN
    in Keras's loss tracker (0/0) on every backend. With `contiguous` (prediction), shard
    r takes the r-th run of consecutive batches instead, so that outputs concatenated in
    rank order are in input order.

    Args:
        dataset: the script's PyDataset (its workers and queue settings are kept).
        num_shards: the number of shards (processes that read).
        index: this process's shard.
        pad: repeat batches rather than give empty ones (training).
        batch_multiplier: the replicas this process feeds.
        equal_steps: every shard takes the same number of steps (training, and steps
            that are collectives).
        contiguous: consecutive runs of batches instead of interleaved ones; needs a
            known length.
    """

    def __init__(self, dataset, num_shards, index, pad, batch_multiplier=1, contiguous=False, equal_steps=True):
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset, self.pad, self.own = dataset, pad, batch_multiplier
        total = dataset.num_batches
        steps = None if total is None else -(-total // (num_shards * batch_multiplier))
        if contiguous and steps is None:
            raise KerasDistError("a PyDataset without a length cannot be split for predict; give it __len__")
        self.per_step = batch_multiplier if contiguous else num_shards * batch_multiplier
        self.first = index * batch_multiplier * (steps if contiguous else 1)
        if not equal_steps and total is not None:
            # This shard's own steps; at least one, as Keras cannot evaluate an empty PyDataset.
            steps = max(1, min(steps, -(-(total - self.first) // self.per_step)))
        self.steps = steps

    @property
    def num_batches(self):
        return self.steps

    def __getitem__(self, step):
        total = self.dataset.num_batches
        wanted = [step * self.per_step + self.first + j for j in range(self.own)]
        if total is not None:
            wanted = [i % total for i in wanted] if self.pad else [i for i in wanted if i < total]
        parts = [self.dataset[i] for i in wanted] or [tree.map_structure(lambda a: a[:0], self.dataset[0])]
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *leaves: np.concatenate(leaves), *parts)

    def on_epoch_begin(self):
        self.dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.dataset.on_epoch_end()


def gather_interleaved(backend, local_outputs, num_shards):
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
