"""Arrays: the interleaved split of any structure of arrays Keras takes, and its inverse for outputs.

Element i goes to shard i mod N. With shuffling off, shard r at batch B then sees, at step
k, exactly the elements of global batch k of one process at batch N*B, so N replicas at
batch B compute the same updates as one process at N*B.

"Arrays" are what Keras's array adapter slices (NumPy, `tf.Tensor` including sparse and
ragged, JAX and torch tensors, pandas DataFrames and Series, scipy sparse matrices),
alone or nested in lists, tuples and dicts. Every rule here maps over the whole structure
(`keras.tree`) and slices each leaf with Keras's own slicing, so a leaf keeps its type.
"""

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import tree

from keras_dist import keras_internals
from keras_dist.errors import KerasDistError
from keras_dist.inputs.base import InputKind, Inputs, mark_equal_steps, may_stand_in, open_ended, ordered_share
from keras_dist.inputs.position import EpochPosition, rest_of_order, steps_left

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas


class InterleavedOutputs(InputKind):
    """A kind split interleaved, whose `predict` outputs come back as arrays' do."""

    def gather(self, replicas: "Replicas", data: Inputs, outputs: Any) -> Any:
        """Outputs of interleaved shards back in input order (padding dropped): `gather_interleaved`."""
        return gather_interleaved(replicas, outputs, replicas.input_plan.num_shards, data.samples)


class ArraysKind(InterleavedOutputs):
    """NumPy arrays, or anything with `__array__`, in any structure Keras takes."""

    def split(self, replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's rows (`shard_arrays`); for `predict` padded too, so that no process runs
        Keras's loop on nothing and steps end together (`gather` drops the padding)."""
        plan, parts = replicas.input_plan, data.arrays
        stand_in = may_stand_in(plan, pad)
        if purpose == "predict" and plan.num_shards > 1:
            pad = True
            data = dataclasses.replace(data, samples=num_samples(parts))
        share = shard_arrays(parts, plan.num_shards, plan.shard_index, pad)
        if stand_in and num_samples(share) == 0:
            share = take_rows(parts, np.zeros(1, dtype=int))
            data = dataclasses.replace(data, stand_in=True)
        batch_size = None if data.batch_size is None else data.batch_size * plan.batch_multiplier
        data = dataclasses.replace(data, **share, batch_size=batch_size)
        if not pad and plan.collective_steps:
            data = Inputs(open_ended(_dataset(data.arrays, data.batch_size)), steps=data.steps)
        return data

    def ordered(self, replicas: "Replicas", data: Inputs, position: EpochPosition, shuffle: bool | str) -> Inputs | None:
        """The training rows in batches, in an order keras_dist draws per epoch (`EpochRows`), where
        `fit` shuffles, or unshuffled in an elastic job (to resume on another count).

        Under several processes "batch" (Keras: shuffle within batch-sized chunks) draws one
        global permutation too: any order kept inside a chunk gives each shard a fixed stride.
        """
        plan, parts = replicas.input_plan, data.arrays
        # Unshuffled, Keras's array adapter keeps its own order, which resumes on the same count;
        # but on TensorFlow every fit reads the rows from `EpochBatches`, whose pipeline is not
        # autotuned (`untuned`: Keras's own began each epoch a second late) and tells an engine
        # that must know equal-step datasets (MultiWorkerMirrored: else its batches lose their
        # static size) that it is one.
        keras_order = not shuffle and not position.elastic and keras.backend.backend() != "tensorflow"
        if keras_order or (shuffle == "batch" and plan.num_shards == 1) \
                or num_samples(parts) == 0:
            return None
        rows = EpochRows(parts, plan.num_shards, plan.shard_index, (data.batch_size or 32) * plan.batch_multiplier,
                         position, shuffle=bool(shuffle), class_weight=data.class_weight)
        return ordered_share(EpochBatches(rows, plan.marks_equal_steps), data, position)


def _dataset(parts: dict, batch_size: int | None) -> Any:
    """The arrays `parts` (by name, None left out) as a `tf.data.Dataset` in batches (Keras's
    default, 32, where None): for strategies whose steps are collectives (TensorFlow's)."""
    import tensorflow as tf

    kept = tuple(parts[k] for k in ("x", "y", "sample_weight") if parts.get(k) is not None)
    return untuned(tf.data.Dataset.from_tensor_slices(for_tf_data(kept if len(kept) > 1 else kept[0]))
                   .batch(batch_size or 32))


def untuned(dataset: Any) -> Any:
    """`dataset` without tf.data's autotuning, for keras_dist's own pipelines over arrays (a
    gather or a slice per batch: nothing to tune). Autotuning runs a thread per iterator,
    and the end of an iterator waits for that thread's next wake-up: Keras ends each epoch's
    iterator as the next begins, so each epoch started 0.5-1.2 s late wherever steps leave
    the core idle (waiting for a collective; bench/results/2026-11-28-cpu-2core-epoch-start.md)."""
    import tensorflow as tf

    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def _leaves(data: Any) -> list:
    return [a for a in tree.flatten(data) if a is not None]


def is_array_input(data: Any) -> bool:
    """Whether `data` is one array, or a structure of them, that Keras's array adapter slices."""
    leaves = _leaves(data)
    return bool(leaves) and all(keras_internals.can_slice_array(a) for a in leaves)


def num_samples(data: Any) -> int:
    """The length of the first dimension shared by every leaf of `data`."""
    lengths = {int(a.shape[0]) for a in _leaves(data)}
    if len(lengths) != 1:
        raise KerasDistError(f"x, y and sample_weight must have the same number of samples, got lengths "
                             f"{sorted(lengths)}; check their first dimensions")
    return lengths.pop()


def take_rows(data: Any, rows: np.ndarray) -> Any:
    """`data` with every leaf cut to `rows` of its first dimension (None leaves kept)."""
    sliceables = keras_internals.convert_to_sliceable(data)
    return tree.map_structure(lambda s: None if s is None else s[rows], sliceables)


def for_tf_data(data: Any) -> Any:
    """`data` as `tf.data.Dataset.from_tensor_slices` takes it, as Keras's adapter gives it: each
    leaf a TensorFlow-compatible array, each list a tuple (a list would be one stacked tensor)."""
    return tree.lists_to_tuples(keras_internals.convert_to_sliceable(data, target_backend="tensorflow"))


def hold_out(data: Any, fraction: float) -> tuple[Any, Any]:
    """Keras's `validation_split` of a structure `(x, y, sample_weight)`: (kept, the last `fraction`)."""
    return keras_internals.train_validation_split(data, validation_split=fraction)


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


class EpochRows(keras.utils.PyDataset):
    """One process's training share of `(x, y, sample_weight)` arrays, in batches, in an order
    keras_dist draws for each epoch, for `fit` that resumes inside an epoch.

    Keras's array adapter shuffles with its backend's global random state, which a
    restarted process cannot bring back. Here epoch e's order is `position.order(e)`, of
    the seed and the epoch alone (or the arrays' own order, unshuffled), split as
    `shard_rows` splits rows (so N replicas at batch B still see what one process at N*B
    does). The epoch resumed goes on after the samples done (`EpochPosition.first_sample`)
    without reading them: the rest of its order is split among this run's processes,
    however many there were before (`rest_of_order`).

    The arrays are packed as Keras's array adapter packs them (`keras_internals.packed_arrays`:
    x alone without y, a single sample_weight repeated for each output, class_weight as
    sample weights), then cast to floatx and wrapped for slicing once, as it does: a batch
    costs its own rows alone. Read as a `PyDataset`, a batch is a tuple, lists in it made
    tuples (as a PyDataset must give it and tf.data takes it), each leaf converted for the
    Keras backend as Keras's array adapter converts it; `fit` reads them through
    `EpochBatches`, in the structure Keras's array adapter gives.

    Args:
        data: the arrays, as a dict `x`, `y`, `sample_weight` (None where `fit` has none).
        num_shards: the processes that read.
        index: this process's shard.
        batch_size: this process's batch size.
        position: the fit's `EpochPosition`.
        shuffle: a new order each epoch; else the arrays' order every epoch.
        class_weight: `fit`'s class_weight.
    """

    unit = "samples"

    def __init__(self, data: dict, num_shards: int, index: int, batch_size: int, position: EpochPosition,
                 shuffle: bool = True, class_weight: dict | None = None) -> None:
        super().__init__()
        self.num_shards, self.index, self.batch_size = num_shards, index, batch_size
        self.position, self.shuffle = position, shuffle
        self.length = num_samples(data)
        self.packed = keras_internals.packed_arrays(data["x"], data["y"], data["sample_weight"], class_weight)
        self.backend = keras.backend.backend()
        self.steps = self.steps_after(0)
        self._rows: tuple[tuple[int, int], np.ndarray] | None = None
        # Whether tf.data reads the rows in batches of a static size (`EpochBatches.get_tf_dataset`).
        self.static_batches = False
        position.resizable, position.step_samples = self, batch_size * num_shards

    def steps_after(self, done: int) -> int:
        return steps_left(self.length, done, self.num_shards, self.batch_size)

    @property
    def num_batches(self) -> int:
        return self.steps

    @functools.cached_property
    def structure(self) -> Any:
        """The nesting of a batch as Keras's array adapter gives it (no lists in tf.data), without arrays."""
        packed = tree.lists_to_tuples(self.packed) if self.backend == "tensorflow" else self.packed
        return tree.map_structure(lambda _: None, packed)

    @functools.cached_property
    def sliceables(self) -> Any:
        # TensorFlow's target gives arrays for tf.data, not sliceables.
        return keras_internals.convert_to_sliceable(self.packed, None if self.backend == "tensorflow" else self.backend)

    def full_batches(self) -> bool:
        """Whether every batch of an epoch holds `batch_size` rows (as in every epoch a resume on
        the same processes and batch size starts inside): Keras's array adapter then gives its
        batches a static first dimension, which model, loss and metric code reads (`tf.squeeze`
        of (None, 1) labels has no rank)."""
        return -(-self.length // self.num_shards) % self.batch_size == 0

    def epoch_rows(self) -> np.ndarray:
        """This process's rows of the epoch under way, in order: batch k is rows k*B to (k+1)*B
        (as many batches as Keras's loop reads in it, `steps_after` where it starts)."""
        epoch = self.position.epoch
        # Keyed by where the epoch starts too: a batch read before the restore (Keras builds
        # the model from one) saw it start at 0.
        key = (epoch, self.position.first_sample(epoch))
        if self._rows is None or self._rows[0] != key:
            order = self.position.order(epoch, self.length) if self.shuffle else np.arange(self.length)
            rows = rest_of_order(order, key[1], self.num_shards)[self.index::self.num_shards].astype(np.int64)
            if self.static_batches and len(rows) % self.batch_size:
                # A resume on another process count or batch size starts inside an epoch whose
                # last batch is short: it takes rows from the shard's start, as padding does,
                # rather than leave the batch size the pipeline promised.
                rows = np.resize(rows, -(-len(rows) // self.batch_size) * self.batch_size)
            self._rows = key, rows
        return self._rows[1]

    def __getitem__(self, step: int) -> tuple:
        rows = self.epoch_rows()
        # Beyond the epoch's batches only where a prefetch reads ahead: wrapped, never used.
        step %= -(-len(rows) // self.batch_size)
        rows = rows[step * self.batch_size:(step + 1) * self.batch_size]
        batch = tree.lists_to_tuples(tree.map_structure(
            lambda s: None if s is None else keras_internals.take_batch(s, rows, self.backend), self.sliceables))
        return batch if isinstance(batch, tuple) else (batch,)


class EpochBatches(keras_internals.data_adapter_class()):
    """What `fit` reads for `EpochRows`: each batch in the structure Keras's array adapter gives
    for the same arrays on this Keras backend (x alone where `fit` has no y, lists where the
    script's were, tuples in tf.data), so that a custom `train_step` gets what it gets without
    keras_dist (a PyDataset's `(x,)` reached keras.io's VAE as one more axis). `fit` takes an
    adapter as it is, class_weight included (`EpochRows` applies it).

    On TensorFlow each batch is gathered inside tf.data from the whole arrays, as Keras's
    array adapter gathers it, with only this epoch's rows from Python; on JAX and PyTorch,
    Keras's PyDataset adapter reads the `EpochRows` (Keras's array adapter slices in Python
    there too).
    """

    def __init__(self, rows: EpochRows, marks_equal_steps: bool = False) -> None:
        self.rows = rows
        # Every process's rows are padded to one length: its tf.data batches match the others'.
        self.marks_equal_steps = marks_equal_steps
        self.adapter = keras_internals.get_data_adapter(rows)

    def _restored(self, batch: Any) -> Any:
        return tree.pack_sequence_as(self.rows.structure, tree.flatten(batch))

    def get_numpy_iterator(self) -> Any:
        return map(self._restored, self.adapter.get_numpy_iterator())

    def get_jax_iterator(self) -> Any:
        return map(self._restored, self.adapter.get_jax_iterator())

    def get_torch_dataloader(self) -> Any:
        # Keras's DataLoader of a PyDataset gives every tuple as a list.
        return map(self._restored, self.adapter.get_torch_dataloader())

    def get_tf_dataset(self) -> Any:
        import tensorflow as tf

        rows = self.rows
        arrays = tree.lists_to_tuples(keras_internals.convert_to_sliceable(rows.packed, target_backend="tensorflow"))
        # The epoch's rows, drawn once each time it is read (`EpochPosition.epoch`), in batches;
        # each batch gathered in parallel. (Read from a `from_generator` instead, a small model's
        # step took 4.5 ms where Keras's own took 2.5, issue 58; from this, 2.5.)
        epoch = tf.data.Dataset.range(1).map(lambda _: tf.reshape(tf.numpy_function(rows.epoch_rows, [], tf.int64), [-1]))
        rows.static_batches = rows.full_batches()
        indices = epoch.unbatch().batch(rows.batch_size, drop_remainder=rows.static_batches)
        batches = tf.data.Dataset.zip((indices, tf.data.Dataset.from_tensors(arrays).repeat()))
        dataset = untuned(batches.map(keras_internals.gather_batch, num_parallel_calls=tf.data.AUTOTUNE)
                          .prefetch(tf.data.AUTOTUNE))
        if self.marks_equal_steps:
            mark_equal_steps(dataset)
        return dataset

    @property
    def num_batches(self) -> int:
        return self.rows.num_batches

    @property
    def batch_size(self) -> int:
        return self.rows.batch_size

    def on_epoch_begin(self) -> None:
        self.adapter.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.adapter.on_epoch_end()


def allgather_parts(replicas: "Replicas", leaf: Any) -> list[np.ndarray]:
    """Every process's `leaf` (first dimensions may differ), in rank order."""
    counts = replicas.collectives.allgather_object(len(leaf))
    stacked = replicas.collectives.allgather_array(np.asarray(leaf))
    return np.split(stacked, np.cumsum(counts)[:-1])


def gather_interleaved(replicas: "Replicas", local_outputs: Any, num_shards: int, length: int | None = None) -> Any:
    """Inverse of the interleaved split: every process gets the whole result.

    Shards may differ in length (unpadded). With `length`, the rows past it (the padding
    of padded shards) are dropped.
    """

    def gather(leaf):
        parts = allgather_parts(replicas, leaf)
        out = np.empty((sum(len(p) for p in parts),) + parts[0].shape[1:], dtype=parts[0].dtype)
        for rank, part in enumerate(parts):
            out[rank::num_shards][:len(part)] = part
        return out if length is None else out[:length]

    return tree.map_structure(gather, local_outputs)
