"""Interleaved input sharding: element i of the input goes to shard i mod N.

With shuffling off, shard r at batch B then sees, at step k, exactly the elements of
global batch k of one process at batch N*B, so N replicas at batch B compute the same
updates as one process at batch N*B.

Training inputs are padded so every shard has the same number of elements (and so the
same number of steps, which collectives need): fewer than N elements are repeated from
the start of the input, once per epoch. Evaluation and prediction inputs are not padded,
so every example is counted exactly once; their steps need no collectives.
"""

import math

import numpy as np
import tensorflow as tf
from keras import tree

from keras_dist.errors import KerasDistError


def is_array_input(data):
    leaves = tree.flatten(data)
    return bool(leaves) and all(isinstance(a, (np.ndarray, tf.Tensor)) or hasattr(a, "__array__") for a in leaves)


def shard_arrays(data, num_shards, index, pad):
    """Shard `index` of a nested structure of equally long arrays (None leaves kept)."""
    leaves = [a for a in tree.flatten(data) if a is not None]
    if not leaves:
        return data
    length = len(leaves[0])
    if any(len(a) != length for a in leaves):
        raise KerasDistError("x, y and sample_weight must have the same number of samples; check their first dimensions")
    if pad and length % num_shards:
        order = np.arange(length + (-length) % num_shards) % length
        return tree.map_structure(lambda a: None if a is None else _take(a, order[index::num_shards]), data)
    return tree.map_structure(lambda a: None if a is None else a[index::num_shards], data)


def _take(array, indices):
    return tf.gather(array, indices) if isinstance(array, tf.Tensor) else np.asarray(array)[indices]


def shard_count(num_examples, num_shards, index):
    """Number of examples shard `index` gets from an unpadded interleaved split."""
    return max(0, math.ceil((num_examples - index) / num_shards))


def dataset_batch_size(dataset):
    """The batch size of a batched `tf.data.Dataset` and whether it drops remainders."""
    first_leaf = tree.flatten(dataset.element_spec)[0]
    if first_leaf.shape.rank == 0:
        raise KerasDistError("the tf.data.Dataset passed to fit/evaluate/predict is not batched; call .batch(batch_size) on it")
    static = first_leaf.shape[0]
    if static is not None:
        return static, True
    for batch in dataset.take(1):
        return int(tree.flatten(batch)[0].shape[0]), False
    return 1, False  # empty dataset: any batch size gives zero steps


def shard_dataset(dataset, num_shards, index, pad, batch_size=None):
    """Shard `index` of a batched dataset, rebatched to `batch_size` (default: its own).

    Datasets whose `experimental_distribute.auto_shard_policy` is OFF are taken as
    already sharded by the user and only rebatched.
    """
    own_batch, drop_remainder = dataset_batch_size(dataset)
    batch_size = batch_size or own_batch
    already_sharded = dataset.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
    if num_shards == 1 or already_sharded:
        if batch_size == own_batch:
            return dataset
        return dataset.rebatch(batch_size, drop_remainder=drop_remainder)
    elements = dataset.unbatch()
    windows = elements.batch(num_shards)
    if pad:
        # Complete the last window with the first elements of the input.
        head = elements.repeat().take(num_shards).batch(num_shards).repeat()
        windows = tf.data.Dataset.zip((windows, head)).map(
            lambda w, h: tree.map_structure(lambda a, b: tf.concat([a, b], 0)[:num_shards], w, h)
        )
    else:
        windows = windows.filter(_whole_element(lambda w: tf.shape(tree.flatten(w)[0])[0] > index))
    shard = windows.map(_whole_element(lambda w: tree.map_structure(lambda a: a[index], w)))
    shard = shard.batch(batch_size, drop_remainder=drop_remainder)
    global_batches = dataset.cardinality()
    if pad and not drop_remainder and own_batch == batch_size and global_batches >= 0:
        # ceil(ceil(M / N) / B) == ceil(ceil(M / B) / N): lets Keras size its progress bar.
        shard = shard.apply(tf.data.experimental.assert_cardinality(-(-global_batches // num_shards)))
    return shard.prefetch(tf.data.AUTOTUNE)


def open_ended(inputs, batch_size):
    """`inputs` as a dataset whose length TensorFlow cannot know in advance.

    Args:
        inputs: a `tf.data.Dataset`, or a dict with "x" and optionally "y" and
            "sample_weight" arrays (None entries are left out).
        batch_size: the batch size for arrays (Keras's default, 32, when None).
    """
    if not isinstance(inputs, tf.data.Dataset):
        arrays = tuple(inputs[k] for k in ("x", "y", "sample_weight") if inputs.get(k) is not None)
        inputs = tf.data.Dataset.from_tensor_slices(arrays if len(arrays) > 1 else arrays[0]).batch(batch_size or 32)
    # Keras then iterates until the distributed iterator ends, which it does on every
    # worker together; a known length would stop workers with shorter shards early.
    return inputs.filter(lambda *_: True)


def _whole_element(fn):
    # tf.data passes a tuple element as separate arguments; hand `fn` the element itself.
    return lambda *parts: fn(parts if len(parts) > 1 else parts[0])


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
