"""`tf.data` sharding: each process reads and preprocesses only its share of a pipeline.

A `tf.data.Dataset` is split interleaved (element i to shard i mod N, as arrays are in
`keras_dist.inputs.arrays`) inside its own pipeline, which is rewritten once per call
(`fit`, `evaluate`, `predict`), never run whole on every worker:

* **Files.** Where the pipeline reads files (TFRecord, text lines, fixed-length records,
  `list_files` + `interleave`, TFDS) and there are at least N files, each process reads
  the files i with i mod N == r, as tf.distribute's FILE auto-shard does. The shard goes
  right after the list of file names, before any shuffle of it.
* **Elements.** Otherwise the stream of elements is split interleaved as early as the
  pipeline allows: just before the run of element-wise steps (`map`, `prefetch`, an
  in-memory `cache`) that leads to the first `batch`. Everything after the split
  (decoding, augmentation) runs on the shard only; the steps before it (a `shuffle`,
  `filter`, `take`, `repeat`, reading a single file) still run on every process, so that
  the interleaved order, and the equivalence above, hold. Every shuffle before the split
  takes seeds all processes agree on, so each epoch's shards are parts of one global
  permutation; an unseeded shuffle among the element-wise steps is moved ahead of them
  (shuffling commutes with them), so decoding still runs on the shard only. One behind an
  in-memory cache, or after the first `batch`, stays where it is: it shuffles this
  shard's own elements (docs/semantics.md).

Training shards are padded so every shard has the same number of elements (and so the
same number of steps, which collectives need): fewer than N elements, taken again from
the start of the input before the split, so each padding element is preprocessed once.
Where the length is unknown (filters, files), the elements before the first element-wise
step are counted once per call. Evaluation and prediction inputs are not padded, so every
example is counted exactly once; prediction never shards files, so its outputs come back
in input order.
"""

import copy
import dataclasses
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.python.framework import op_def_registry, tensor_util
from tensorflow.python.ops import gen_experimental_dataset_ops

from keras_dist.errors import KerasDistError
from keras_dist.inputs.arrays import InterleavedOutputs
from keras_dist.inputs.base import STEPS, Inputs, has_equal_steps, mark_equal_steps, may_stand_in, open_ended
from keras_dist.overrides import set_while

if TYPE_CHECKING:
    from tensorflow.core.framework import node_def_pb2

    from keras_dist.inputs.position import EpochPosition
    from keras_dist.replicas import Replicas


class TFDataKind(InterleavedOutputs):
    """A `tf.data.Dataset`: its pipeline is rewritten so each process reads and preprocesses its share."""

    def split(self, replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's share of the pipeline (`shard_dataset`); with a step count the epoch ends
        there, without one training shards are padded to equal steps."""
        plan, source = replicas.input_plan, data.x
        if plan.num_shards > 1 and data.steps is None and is_infinite(source):
            caller = "fit" if purpose == "validation" else purpose
            raise KerasDistError(f"the dataset is infinite (it repeats); pass {STEPS[purpose]} to {caller}")
        share, equal_steps = shard_dataset(source, plan.num_shards, plan.shard_index, pad and data.steps is None,
                                           plan.batch_multiplier, files=purpose != "predict",
                                           allgather=replicas.collectives.allgather_object)
        if may_stand_in(plan, pad) and is_empty(share):
            share = source.take(1)  # the first batch stands in for an empty share
            data = dataclasses.replace(data, stand_in=True)
        data = dataclasses.replace(data, x=share)
        if not pad and plan.collective_steps:
            data = Inputs(open_ended(share), steps=data.steps)
        if equal_steps and plan.marks_equal_steps:
            mark_equal_steps(data.x)
        return data

    def ordered(self, replicas: "Replicas", data: Inputs, position: "EpochPosition", shuffle: bool | str) -> None:
        """None: a pipeline's order is its own (its shuffles, seeded or not); a resumed epoch reads
        it from the start and drops the batches done."""
        return None


def distribute_share(strategy: tf.distribute.Strategy, dataset: tf.data.Dataset, options: Any = None) -> Any:
    """`dataset`, this worker's share (keras_dist split it), distributed by `strategy` (a
    `tf.distribute` strategy of several workers, MultiWorkerMirrored) to its local replicas,
    as the strategy's `experimental_distribute_dataset` must: TensorFlow would split it again.

    Each local replica gets whole batches of the process batch divided by their count, and
    steps stay as Keras counts them.
    """
    equal_steps = has_equal_steps(dataset)
    if dataset.options().autotune.enabled is None:
        # Without tf.data's autotuning thread, unless the script asks for it: freeing an
        # iterator waits for that thread, which may sleep up to a minute between rounds, so a
        # worker could outlive the job's deadline at exit (docs/backends.md). AUTOTUNE
        # parallelism stays at its starting value.
        no_autotune = tf.data.Options()
        no_autotune.autotune.enabled = False
        dataset = dataset.with_options(no_autotune)
    devices = strategy.extended.worker_devices
    if len(devices) > 1:
        batch, _ = dataset_batch_size(dataset)
        dataset = dataset.rebatch(-(-batch // len(devices)))
    elif equal_steps and options is None and "CPU" in devices[0].upper():
        # One replica on the host, batches of equal sizes everywhere: the replica takes the
        # worker's batches as they are. TensorFlow's per-device iterator would copy them to
        # the same host through a pipeline of its own, autotuned whatever the source's
        # options, whose end at each epoch waits for its tuning thread.
        return dataset
    if not equal_steps:
        return strategy.distribute_datasets_from_function(lambda _: dataset, options)
    # Every worker has batches of the same sizes (keras_dist padded the shards), so the
    # all-reduce tf.distribute runs at every step, asking whether every worker still has
    # data, can go.
    with set_while(strategy.extended, "experimental_enable_get_next_as_optional", False):
        return strategy.distribute_datasets_from_function(lambda _: dataset, options)


def dataset_batch_size(dataset: tf.data.Dataset) -> tuple[int, bool]:
    """The batch size of a batched `tf.data.Dataset` and whether it drops remainders."""
    first_leaf = tree.flatten(dataset.element_spec)[0]
    if first_leaf.shape.rank == 0:
        raise _not_batched()
    static = first_leaf.shape[0]
    if static is not None:
        return static, True
    for batch in dataset.take(1):
        return int(tree.flatten(batch)[0].shape[0]), False
    return 1, False  # empty dataset: any batch size gives zero steps


def _not_batched():
    return KerasDistError("the tf.data.Dataset passed to fit/evaluate/predict is not batched; "
                          "call .batch(batch_size) on it (the batch size is per replica)")


def shard_dataset(dataset: tf.data.Dataset, num_shards: int, index: int, pad: bool, batch_multiplier: int = 1,
                  files: bool = True, allgather: Callable[[Any], list] | None = None) -> tuple[tf.data.Dataset, bool]:
    """This process's share of a batched dataset, each batch `batch_multiplier` times larger,
    and whether every process's share has the same number of batches of the same sizes.

    Args:
        dataset: the script's batched `tf.data.Dataset`. One whose
            `experimental_distribute.auto_shard_policy` is OFF is taken as already
            sharded by the user and only rebatched.
        num_shards: the number of shards (processes that read).
        index: this process's shard.
        pad: pad shards to equal length (training).
        batch_multiplier: the replicas this process feeds (the dataset's batch is per replica).
        files: whether shards may be made of whole files (not for `predict`, whose
            outputs must come back in input order).
        allgather: `fn(obj) -> [obj of every process]`, to agree on the padded length of
            file shards; None for a single process (tests).
    """
    already_sharded = dataset.options().experimental_distribute.auto_shard_policy == tf.data.experimental.AutoShardPolicy.OFF
    equal_steps = False
    if num_shards > 1 and not already_sharded:
        try:
            pipeline = Pipeline(dataset)
            equal_steps = pad and pipeline.steps_follow_elements()
            dataset = pipeline.sharded(num_shards, index, pad, files, allgather)
        except _Unrewritable as exc:
            warnings.warn(f"keras_dist cannot shard this tf.data pipeline at its source ({exc}); every worker runs "
                          "all of it and keeps its share", stacklevel=2)
            dataset = _shard_after_pipeline(dataset, num_shards, index, pad)
            equal_steps = pad
    if batch_multiplier > 1:
        own_batch, drop_remainder = dataset_batch_size(dataset)
        dataset = dataset.rebatch(own_batch * batch_multiplier, drop_remainder=drop_remainder)
    return dataset, equal_steps


def _shard_after_pipeline(dataset, num_shards, index, pad):
    """The fallback: run the whole pipeline, keep every N-th element, batch as before."""
    own_batch, drop_remainder = dataset_batch_size(dataset)
    elements = dataset.unbatch()
    if pad:
        missing = -_length(elements) % num_shards
        elements = elements.concatenate(elements.take(missing))
    return elements.shard(num_shards, index).batch(own_batch, drop_remainder=drop_remainder)


def is_empty(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` gives nothing: from its cardinality, else by reading one element."""
    length = int(dataset.cardinality())
    if length == tf.data.UNKNOWN_CARDINALITY:
        return not any(True for _ in dataset.take(1))
    return length == 0


def is_infinite(dataset: tf.data.Dataset) -> tf.Tensor:  # a scalar boolean tensor, which `if` reads eagerly
    return dataset.cardinality() == tf.data.INFINITE_CARDINALITY


def _length(dataset):
    """The number of elements of a finite dataset, counted only if TensorFlow cannot tell."""
    length = int(dataset.cardinality())
    if length == tf.data.INFINITE_CARDINALITY:
        raise KerasDistError("the dataset is infinite (it repeats); pass steps_per_epoch to fit "
                             "(steps to evaluate/predict)")
    if length == tf.data.UNKNOWN_CARDINALITY:
        length = int(dataset.reduce(np.int64(0), lambda count, _: count + 1))
    return length


# --- the pipeline as a graph ------------------------------------------------------------
# Op names of TensorFlow's dataset kernels, by their role in choosing where to split.
_BATCH_OPS = {"BatchDataset", "BatchDatasetV2", "PaddedBatchDataset", "PaddedBatchDatasetV2", "ParallelBatchDataset",
              "MapAndBatchDataset", "ExperimentalMapAndBatchDataset", "DenseToSparseBatchDataset",
              "ExperimentalDenseToSparseBatchDataset"}
# One output element per input element, in order: a split commutes with them.
_ELEMENTWISE_OPS = {"MapDataset", "ParallelMapDataset", "ParallelMapDatasetV2", "PrefetchDataset", "OptionsDataset",
                    "ModelDataset", "MaxIntraOpParallelismDataset", "ExperimentalMaxIntraOpParallelismDataset",
                    "PrivateThreadPoolDataset", "ExperimentalPrivateThreadPoolDataset"}
# Ops that form batches of their own (bucket_by_sequence_length) and that merge datasets.
_GROUPING_OPS = {"GroupByWindowDataset", "ExperimentalGroupByWindowDataset", "GroupByReducerDataset",
                 "ExperimentalGroupByReducerDataset"}
_MERGING_OPS = {"ZipDataset", "ConcatenateDataset"}
_SHUFFLE_OPS = {"ShuffleDataset", "ShuffleDatasetV3"}  # inputs 2 and 3 are the seeds
_CACHE_OPS = {"CacheDataset", "CacheDatasetV2"}  # input 1 is the file name ("" in memory)
_READER_OPS = {"TFRecordDataset", "TFRecordDatasetV2", "TextLineDataset", "FixedLengthRecordDataset",
               "FixedLengthRecordDatasetV2"}
# Ops that turn each input element (a file name) into a dataset through a function.
_EXPANDING_OPS = {"FlatMapDataset", "InterleaveDataset", "ParallelInterleaveDataset", "ParallelInterleaveDatasetV2",
                  "ParallelInterleaveDatasetV3", "ParallelInterleaveDatasetV4", "LegacyParallelInterleaveDatasetV2",
                  "ExperimentalParallelInterleaveDataset"}


class _Unrewritable(Exception):
    """The pipeline cannot be split inside (it is not serializable, or has no linear chain)."""


def dataset_graph(dataset: tf.data.Dataset) -> graph_pb2.GraphDef:
    """The `GraphDef` of `dataset`'s ops (random ops and other state included as they are)."""
    try:
        serialized = dataset._as_serialized_graph(external_state_policy=tf.data.experimental.ExternalStatePolicy.IGNORE)
        return graph_pb2.GraphDef.FromString(serialized.numpy())
    except (tf.errors.OpError, ValueError, TypeError) as exc:
        raise _Unrewritable(str(exc).splitlines()[0]) from None


_PYTHON_OPS = {"PyFunc", "PyFuncStateless", "EagerPyFunc"}  # from_generator, py_function, numpy_function


def runs_python(dataset: tf.data.Dataset) -> bool:
    """Whether `dataset` calls Python (it then cannot run in another process), or cannot be serialized."""
    try:
        graph = dataset_graph(dataset)
    except _Unrewritable:
        return True
    nodes = [*graph.node, *(node for function in graph.library.function for node in function.node_def)]
    return any(node.op in _PYTHON_OPS for node in nodes)


class Pipeline:
    """A `tf.data.Dataset` as the `GraphDef` of its ops, to insert a split into.

    The ops from the source to the end form a chain (each reads the one before). Multi-input
    ops (zip, concatenate) count as sources: the split goes after them.
    """

    def __init__(self, dataset: tf.data.Dataset) -> None:
        self.element_spec = dataset.element_spec
        self.graph = dataset_graph(dataset)
        self.nodes = {node.name: node for node in self.graph.node}
        self._own_memory_caches()
        self.output = next(node for node in self.graph.node if node.op == "_Retval")
        self.chain = self._chain(self.nodes[_node_name(self.output.input[0])])  # source first
        # A zip or concatenation of datasets that each batch in a chain of their own: each
        # chain is split before its batch, as one dataset is (`_branches_sharded`).
        self.branches: list[Pipeline] = []
        batches = [i for i, node in enumerate(self.chain) if node.op in _BATCH_OPS | _GROUPING_OPS]
        if not batches:
            if self._batched_before(self.chain[0]):
                batches = [0]  # a zip or concatenation of batched datasets: its elements are batches
                self.branches = self._branches(self.chain[0])
            elif any(node.op in _EXPANDING_OPS and not self._function_reads_files(node.attr["f"].func.name)
                     or "Window" in node.op for node in self.chain):
                raise _Unrewritable("it batches inside a function")
            else:
                raise _not_batched()
        self.first_batch = batches[0]
        # Where batches form in a bucketing op, or in branches that do not each batch in a
        # chain, elements cannot be split before them: whole batches are split interleaved
        # instead (batch i to shard i mod N), which gives the N replicas of one step the
        # batches one process at N x B reads.
        self.splits_batches = self.chain[self.first_batch].op not in _BATCH_OPS and not self.branches

    def _own_memory_caches(self):
        """Gives this rewrite caches of its own. An in-memory cache's resource is serialized
        as a handle to the script's one: every rewrite of the dataset in this process (fit's
        shard, then evaluate's) read what the first filled. The first version of the op keeps
        its memory in the dataset."""
        for node in self.graph.node:
            if node.op == "CacheDatasetV2" and self._constant(node, 1) == b"":
                node.op = "CacheDataset"
                del node.input[2:]

    def _branches(self, merge) -> list["Pipeline"]:
        """The chains of a zip's or concatenation's inputs, each as a pipeline of the same graph
        (none where one of them batches otherwise than in its own chain)."""
        branches = []
        for name in merge.input:
            node = self.nodes[_node_name(name)]
            if name.startswith("^") or not _is_dataset(node):
                continue
            branch = copy.copy(self)
            branch.chain = self._chain(node)
            batches = [i for i, n in enumerate(branch.chain) if n.op in _BATCH_OPS]
            if not batches:
                return []
            branch.first_batch, branch.branches, branch.splits_batches = batches[0], [], False
            branches.append(branch)
        return branches

    def _batched_before(self, node) -> bool:
        """Whether each input of a zip or concatenation (`node`) gives batches, as Keras
        takes them: each branch batches (or zips batched datasets) on its way to `node`."""
        if node.op not in _MERGING_OPS:
            return False
        branches = [self.nodes[_node_name(i)] for i in node.input if not i.startswith("^")]
        return all(self._branch_batches(branch) for branch in branches if _is_dataset(branch))

    def _branch_batches(self, node) -> bool:
        while True:
            if node.op in _BATCH_OPS | _GROUPING_OPS:
                return True
            if node.op in _MERGING_OPS:
                return self._batched_before(node)
            inputs = [self.nodes[_node_name(i)] for i in node.input if not i.startswith("^")]
            datasets = [n for n in inputs if _is_dataset(n)]
            if not datasets:
                return False
            node = datasets[0]

    def steps_follow_elements(self) -> bool:
        """Whether equal element counts per shard give equal batches: nothing after the
        first batch drops, adds or regroups elements."""
        return not self.splits_batches and all(node.op in _ELEMENTWISE_OPS | _SHUFFLE_OPS | _CACHE_OPS
                                               for node in self.chain[self.first_batch + 1:])

    def _chain(self, end):
        """The ops from a source (a file list, a zip...) to `end`, each reading the one before."""
        chain = [end]
        while True:
            inputs = [self.nodes[_node_name(i)] for i in chain[-1].input if not i.startswith("^")]
            datasets = [node for node in inputs if _is_dataset(node)]
            if len(datasets) != 1 or datasets[0] is not inputs[0]:
                return chain[::-1]
            chain.append(datasets[0])

    def sharded(self, num_shards: int, index: int, pad: bool, files: bool,
                allgather: Callable[[Any], list] | None) -> tf.data.Dataset:
        """The dataset split into `num_shards`, shard `index` (see the module docstring)."""
        if self.splits_batches:
            return self._batches_sharded(num_shards, index, pad, allgather)
        if self.branches:
            return self._branches_sharded(num_shards, index, pad, allgather)
        split = self._element_split_point()
        file_source = self._file_source(num_shards) if files else None
        if file_source is not None:
            self._insert_after(file_source, self._shard(num_shards, index, file_source))
            if pad:
                count = self._count(split)
                counts = allgather(count) if allgather else [count] * num_shards
                self._pad(split, max(counts) - counts[index])
        else:
            self._elements_sharded(num_shards, index, pad, allgather)
        return self.dataset()

    def _elements_sharded(self, num_shards, index, pad, allgather, length=None):
        """Splits the elements interleaved before the run of element-wise steps that leads to
        the first batch; the first `length` of them only, if given."""
        split = self._shuffle_before_split(self._element_split_point())
        self._same_order_before(split, allgather)
        count = self._count(split)
        end = split
        if length is not None and count > length:
            end = self._take(end, length)
            count = length
        end = self._pad(end, -count % num_shards) if pad else end
        self._insert_after(end, self._shard(num_shards, index, end))

    def _branches_sharded(self, num_shards, index, pad, allgather):
        """Each input of the zip (or concatenation) split before its batch, element i to shard
        i mod N in every one: a zip's pairs stay pairs. A zip's inputs are cut to the shortest's
        elements first, so that padding pairs elements of the same place too."""
        length = None
        if self.chain[0].op == "ZipDataset":
            length = min(branch._count(branch._element_split_point()) for branch in self.branches)
        for branch in self.branches:
            branch._elements_sharded(num_shards, index, pad, allgather, length)
        return self.dataset()

    def _batches_sharded(self, num_shards, index, pad, allgather):
        """The batches split interleaved right where they form (before the element-wise
        steps that follow), padded with the first batches to a multiple of N for training."""
        split = self.chain[self.first_batch]
        for node in self.chain[self.first_batch + 1:]:
            if not _commutes_with_split(node, self._constant):
                break
            split = node
        self._same_order_before(split, allgather)
        end = self._pad(split, -self._count(split) % num_shards) if pad else split
        self._insert_after(end, self._shard(num_shards, index, end))
        return self.dataset()

    def _same_order_before(self, split, allgather):
        """Makes every process produce the elements before `split` in one order.

        Otherwise the interleaved split would give some elements to two shards and others
        to none. Parallel steps become deterministic, and every shuffle takes the chief's
        seeds: its own where it has them (the same order as one process), else random
        ones, so that runs still differ. A per-worker seed (`tf.random.set_seed(rank)`)
        therefore reorders nothing before the split.
        """
        before = self.chain[:self.chain.index(split) + 1]
        for node in before:
            if "deterministic" in node.attr:
                node.attr["deterministic"].s = b"true"
        shuffles = [node for node in before if node.op in _SHUFFLE_OPS]
        if not shuffles:
            return
        random = [int(seed) for seed in np.random.default_rng().integers(1, 2**31, 2)]
        own = [[int(self._constant(node, i) or 0) for i in (2, 3)] for node in shuffles]
        proposed = [seeds if any(seeds) else random for seeds in own]
        agreed = allgather(proposed)[0] if allgather else proposed
        for node, (seed, seed2) in zip(shuffles, agreed):
            # ShuffleDataset takes its seeds as given and reshuffles each epoch as V3 does
            # with the same seeds; V3's seed generator was made from this process's seeds.
            node.op = "ShuffleDataset"
            node.input[:] = [node.input[0], node.input[1], self._const(seed), self._const(seed2)]

    def _shuffle_before_split(self, split):
        """Where an unseeded shuffle follows `split` across element-wise steps only, moves it to
        just after `split` and returns it as the split point; else returns `split`.

        Split before it, each shard would shuffle a fixed stride of the data (element i to
        shard i mod N in every epoch): a data set with a period dividing N (labels 0, 1, 0,
        1) gives each replica one class. Shuffled first, with seeds every process agrees on
        (`_same_order_before`), each epoch's shards are parts of one global permutation,
        while the element-wise steps it moved over still run on the shard only. A shuffle
        behind an in-memory cache stays: moved before it, the cache would keep its first
        epoch's order for good.
        """
        start = self.chain.index(split) + 1
        for position in range(start, self.first_batch):
            node = self.chain[position]
            if node.op in _CACHE_OPS:
                return split
            if node.op in _SHUFFLE_OPS:
                break
        else:
            return split
        if position > start:
            # Reads what the step it now precedes read: its elements take their types.
            consumer = self.chain[position + 1]
            consumer.input[0] = node.input[0]
            before, after = self.chain[start - 1], self.chain[start]
            node.input[0], after.input[0] = before.name, node.name
            node.attr["output_types"].CopyFrom(_output_types(before))
            node.attr["output_shapes"].CopyFrom(before.attr["output_shapes"])
            self.chain.insert(start, self.chain.pop(position))
        return node

    def _element_split_point(self):
        """The last node before the run of element-wise ops that leads to the first batch."""
        position = self.first_batch - 1
        while position > 0 and _commutes_with_split(self.chain[position], self._constant):
            position -= 1
        return self.chain[position]

    def _file_source(self, num_shards):
        """The node listing file names, if the chain reads at least `num_shards` files."""
        for node in self.chain[1:self.first_batch]:
            if node.op in _EXPANDING_OPS and self._function_reads_files(node.attr["f"].func.name):
                source = self.chain[0]
                if source.op == "TensorSliceDataset" and self._count(source) >= num_shards:
                    return source
                return None
        return None

    def _function_reads_files(self, name, seen=()):
        functions = {f.signature.name: f for f in self.graph.library.function}
        if name not in functions or name in seen:
            return False
        for node in functions[name].node_def:
            if node.op in _READER_OPS:
                return True
            called = [a.func.name for a in node.attr.values() if a.HasField("func")]
            if any(self._function_reads_files(f, seen + (name,)) for f in called):
                return True
        return False

    def _constant(self, node, position):
        source = self.nodes[_node_name(node.input[position])]
        return tensor_util.MakeNdarray(source.attr["value"].tensor) if source.op == "Const" else None

    # --- editing ----------------------------------------------------------------------
    def _add(self, op, inputs, like, **attrs):
        node = self.graph.node.add(name=f"keras_dist/{op}/{len(self.graph.node)}", op=op, input=inputs)
        node.attr["output_types"].CopyFrom(_output_types(like))
        node.attr["output_shapes"].CopyFrom(like.attr["output_shapes"])
        for key, value in attrs.items():
            node.attr[key].b = value
        self.nodes[node.name] = node
        return node

    def _const(self, value):
        node = self.graph.node.add(name=f"keras_dist/Const/{len(self.graph.node)}", op="Const")
        node.attr["dtype"].type = types_pb2.DT_INT64
        node.attr["value"].tensor.CopyFrom(tensor_util.make_tensor_proto(value, tf.int64))
        return node.name

    def _shard(self, num_shards, index, after):
        return self._add("ShardDataset", [after.name, self._const(num_shards), self._const(index)], after,
                         require_non_empty=False)

    def _take(self, after, count):
        """Keeps the first `count` elements of `after`; returns the chain's new node."""
        head = self._add("TakeDataset", [after.name, self._const(count)], after)
        self._insert_after(after, head)
        return head

    def _pad(self, after, count):
        """Appends the first `count` elements of `after` to it; returns the chain's new node."""
        if count <= 0:
            return after
        head = self._add("TakeDataset", [after.name, self._const(count)], after)
        padded = self._add("ConcatenateDataset", [after.name, head.name], after)
        self._insert_after(after, padded)
        return padded

    def _insert_after(self, node, new):
        """Makes the chain read `new` where it read `node` (`new` reads `node`)."""
        position = next(i for i, n in enumerate(self.chain) if n is node)
        consumer = self.chain[position + 1] if position + 1 < len(self.chain) else self.output
        consumer.input[0] = new.name
        self.chain.insert(position + 1, new)
        if position < self.first_batch:
            self.first_batch += 1

    def _count(self, node):
        """The number of elements `node` gives (counted once if TensorFlow cannot tell)."""
        return _length(self.dataset(node))

    def dataset(self, node: "node_def_pb2.NodeDef | None" = None) -> tf.data.Dataset:
        """The pipeline as a dataset; up to `node` only (elements as flat tuples) if given."""
        graph = graph_pb2.GraphDef()
        graph.CopyFrom(self.graph)
        if node is None:
            spec = self.element_spec
        else:
            next(n for n in graph.node if n.op == "_Retval").input[0] = node.name
            spec = tuple(tf.TensorSpec(tf.TensorShape(shape), dtype)
                         for shape, dtype in zip(node.attr["output_shapes"].list.shape, _output_types(node).list.type))
        try:
            variant = gen_experimental_dataset_ops.dataset_from_graph(graph.SerializeToString())
        except tf.errors.OpError as exc:
            raise _Unrewritable(str(exc).splitlines()[0]) from None
        return tf.data.experimental.from_variant(variant, spec)


def _output_types(node):
    return node.attr["Toutput_types" if "Toutput_types" in node.attr else "output_types"]


def _node_name(tensor_name):
    return tensor_name.lstrip("^").split(":")[0]


def _is_dataset(node):
    op_def = op_def_registry.get(node.op)
    return op_def is not None and len(op_def.output_arg) == 1 and op_def.output_arg[0].type == types_pb2.DT_VARIANT \
        and node.op != "Const"


def _commutes_with_split(node, constant):
    """Whether splitting before `node` gives each shard what splitting after it would."""
    if node.op in _ELEMENTWISE_OPS:
        return True
    if node.op in _CACHE_OPS:
        return constant(node, 1) == b""  # a cache file would be shared by every process
    if node.op in _SHUFFLE_OPS:
        return constant(node, 2) == 0 and constant(node, 3) == 0  # unseeded: there is no order to keep
    return False
