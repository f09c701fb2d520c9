"""tf.data pipelines under 2 Horovod ranks and 2 MultiWorkerMirrored workers: who preprocesses what.

tests/workers/input_pipeline.py logs, per worker, the ids of the elements its pipeline's
map ran on. Each worker must preprocess only its share, and together the workers must
cover the input once (plus fewer than N padding elements when the length is odd).
"""

import importlib.util
import json
import os

import numpy as np
import pytest
import tensorflow as tf

from runner import BIN, WORKERS, horovodrun, rotated, run

import runner

from keras_dist.inputs import py_dataset, tf_data  # noqa: E402
from keras_dist.errors import KerasDistError  # noqa: E402

pytestmark = pytest.mark.timeout(600)
_spec = importlib.util.spec_from_file_location("batched_datasets", WORKERS / "batched_datasets.py")
batched_datasets = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(batched_datasets)
FILE_SIZES = [32, 32, 32, 32]  # equal files: file shards need no padding


def write_records(directory, sizes):
    """TFRecord files of the given sizes holding consecutive int64 ids."""
    start = 0
    for index, size in enumerate(sizes):
        with tf.io.TFRecordWriter(os.path.join(directory, f"part-{index:02d}.tfrecord")) as writer:
            for i in range(start, start + size):
                writer.write(np.int64(i).tobytes())
        start += size


@pytest.fixture(scope="module", params=["horovod", "multi_worker_mirrored"])
def workers(request, tmp_path_factory):
    out, files = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("files")
    write_records(files, FILE_SIZES)
    argv = [WORKERS / "input_pipeline.py", out, files]
    if request.param == "horovod":
        code, output = horovodrun(2, argv, timeout=300)
        assert code == 0, output[-4000:]
    else:
        runner.run_python_ok([argv, argv], runner.tf_config_envs(2), timeout=300)
    results = []
    for rank in range(2):
        with open(out / f"input.{rank}.json") as f:
            results.append(json.load(f))
    return results


def mapped(workers, case):
    return [w[case]["mapped"] for w in workers]


@pytest.mark.parametrize("case", ["elements", "seeded_shuffle", "unseeded_shuffle", "unseeded_shuffle_after_map",
                                  "rank_seeded_shuffle"])
def test_each_worker_preprocesses_only_its_interleaved_share(workers, case):
    rank0, rank1 = mapped(workers, case)
    # 250 elements: 125 each, nothing left over, nothing preprocessed twice.
    assert len(rank0) == len(rank1) == 125
    assert sorted(rank0 + rank1) == list(range(250))
    if case == "elements":
        assert sorted(rank0) == list(range(0, 250, 2)) and sorted(rank1) == list(range(1, 250, 2))
    else:  # shuffled: shares of one global permutation, not a fixed stride (issue 47)
        assert 40 < sum(i % 2 for i in rank0) < 85, rank0


def test_distribute_dataset_gives_a_loop_of_the_scripts_own_its_interleaved_share(workers):
    unpadded = [w["distribute_dataset"]["False"] for w in workers]
    assert unpadded == [[[0, 2], [4, 6], [8]], [[1, 3], [5, 7], [9]]]
    padded = [w["distribute_dataset"]["True"] for w in workers]
    assert [len(p) for p in padded] == [3, 3] and sorted(sum(sum(padded, []), [])) == list(range(10))


def test_seeded_shuffle_keeps_one_process_order_split_interleaved(workers):
    order = workers[0]["one_process_order"]
    rank0, rank1 = mapped(workers, "seeded_shuffle")
    assert rank0 == order[0::2] and rank1 == order[1::2]


@pytest.mark.parametrize("case", ["files", "listed_files"])
def test_file_shards_read_every_file_exactly_once_per_epoch(workers, case):
    rank0, rank1 = mapped(workers, case)
    assert sorted(rank0 + rank1) == list(range(sum(FILE_SIZES)))
    # Whole files per worker: file i goes to worker i mod 2.
    file_of = np.repeat(np.arange(len(FILE_SIZES)), FILE_SIZES)
    assert {int(file_of[i]) % 2 for i in rank0} == {0} and {int(file_of[i]) % 2 for i in rank1} == {1}


def test_fewer_files_than_workers_split_elements_and_pad_once(workers):
    rank0, rank1 = mapped(workers, "one_file")  # one file of 32: elements split, no padding needed
    assert rank0 == list(range(0, 32, 2)) and rank1 == list(range(1, 32, 2))


def test_unknown_length_is_counted_and_padded_with_fewer_than_n_elements(workers):
    kept = [i for i in range(250) if i % 5 > 0]  # 200 kept: even split
    rank0, rank1 = mapped(workers, "filtered")
    assert rank0 == kept[0::2] and rank1 == kept[1::2]
    assert workers[0]["filtered"]["loss"] == workers[1]["filtered"]["loss"]


def test_bad_inputs_get_one_line_errors(workers):
    for errors in (w["bad_inputs"] for w in workers):
        assert "pass steps_per_epoch to fit" in errors["infinite"]
        assert "call .batch(batch_size)" in errors["unbatched"]
        assert "non-empty" in errors["empty_arrays"]
        assert all("\n" not in message for message in errors.values())


# --- the split itself, in one process ------------------------------------------------------


def shards(dataset, count, pad, **options):
    return [[b.tolist() for b in tf_data.shard_dataset(dataset, count, r, pad, **options)[0].as_numpy_iterator()]
            for r in range(count)]


def test_one_replica_on_the_host_reads_its_workers_pipeline_as_it_is(workers, request):
    """MultiWorkerMirrored, one CPU replica per worker: TensorFlow's per-device iterator added
    an autotuned pipeline whose end at each epoch waited for its tuning thread
    (bench/results/2026-11-28-cpu-2core-mwms-timeline.md). Shares of
    unequal steps keep TensorFlow's distributed dataset, which ends on every worker together."""
    if request.node.callspec.params["workers"] != "multi_worker_mirrored":
        pytest.skip("MultiWorkerMirrored's input; Horovod feeds Keras the share itself")
    for worker in workers:
        read = worker["replica_input"]
        assert read["equal"] == "tf.data.Dataset" and read["unequal"].startswith("DistributedDataset"), read


def test_odd_lengths_pad_fewer_than_n_elements_from_the_start():
    dataset = tf.data.Dataset.range(11).map(lambda i: i * 10).batch(4)
    assert shards(dataset, 3, pad=False) == [[[0, 30, 60, 90]], [[10, 40, 70, 100]], [[20, 50, 80]]]
    assert shards(dataset, 3, pad=True) == [[[0, 30, 60, 90]], [[10, 40, 70, 100]], [[20, 50, 80, 0]]]
    assert tf_data.shard_dataset(dataset, 3, 0, pad=True)[0].cardinality() == 1  # Keras sizes its progress bar


def test_the_batch_grows_for_processes_that_feed_several_replicas():
    dataset = tf.data.Dataset.range(16).batch(2)
    assert shards(dataset, 2, pad=False, batch_multiplier=2)[1] == [[1, 3, 5, 7], [9, 11, 13, 15]]


def test_prediction_never_shards_files_so_outputs_keep_input_order(tmp_path):
    write_records(tmp_path, [3, 3])
    dataset = tf.data.TFRecordDataset(sorted(map(str, tmp_path.iterdir()))).map(
        lambda r: tf.io.decode_raw(r, tf.int64)[0]).batch(2)
    assert shards(dataset, 2, pad=False, files=False) == [[[0, 2], [4]], [[1, 3], [5]]]
    assert shards(dataset, 2, pad=False) == [[[0, 1], [2]], [[3, 4], [5]]]


def test_a_pipeline_that_batches_inside_a_function_falls_back_with_a_warning():
    dataset = tf.data.Dataset.range(8).window(2).flat_map(lambda w: w.batch(2))
    with pytest.warns(UserWarning, match="cannot shard this tf.data pipeline at its source"):
        assert shards(dataset, 2, pad=True) == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]


def _rows(dataset):
    """Every element of a batched dataset, as a comparable tuple of its leaves' bytes (trailing
    zeros dropped: `padded_batch` pads an element to its batch's longest)."""
    rows = []
    for batch in dataset.as_numpy_iterator():
        leaves = [np.asarray(leaf) for leaf in tf.nest.flatten(batch)]
        rows += [tuple(np.asarray(leaf[i]).tobytes().rstrip(b"\0") for leaf in leaves) for i in range(len(leaves[0]))]
    return sorted(rows)


def test_every_batched_construction_splits_into_shards_that_cover_it_once(tmp_path):
    """Zips and concatenations of batched datasets, `timeseries_dataset_from_array`, bucketing
    and the directory loaders are batched as Keras takes them; the shards of 2 and 3 processes
    hold every element once, and padded ones end at the same step."""
    for name, dataset in batched_datasets.constructions(tmp_path).items():
        whole = _rows(dataset)
        for count in (2, 3):
            parts = [tf_data.shard_dataset(dataset, count, r, pad=False)[0] for r in range(count)]
            assert sorted(sum((_rows(part) for part in parts), [])) == whole, f"{name}, {count} shards"
            padded = [tf_data.shard_dataset(dataset, count, r, pad=True)[0] for r in range(count)]
            steps = {sum(1 for _ in part) for part in padded}
            assert len(steps) == 1, f"{name}, {count} padded shards: steps {steps}"


def test_unbatched_datasets_are_a_one_line_error():
    elements = tf.data.Dataset.from_tensor_slices(np.zeros((4, 8, 8, 3)))
    for dataset in (tf.data.Dataset.range(4), elements, tf.data.Dataset.zip((elements, elements))):
        with pytest.raises(KerasDistError, match=r"call \.batch\(batch_size\)"):
            tf_data.shard_dataset(dataset, 2, 0, pad=True)


class _AgreedSeeds:
    """The `allgather` of shards made one after another in one process: every call after the
    first gets the first call's proposal, as every process gets the chief's."""

    def __init__(self, num_shards):
        self.num_shards, self.first = num_shards, None

    def __call__(self, proposal):
        self.first = proposal if self.first is None else self.first
        return [self.first] * self.num_shards


def _epochs(shards, count):
    """`count` epochs of each shard of one call: [epoch][shard] -> the ids it served, in order."""
    return [[[int(i) for batch in shard for i in np.ravel(batch)] for shard in shards] for _ in range(count)]


def assert_global_permutations(epochs, length):
    """Each epoch's shards are parts of one permutation, none a fixed stride, none the same twice."""
    for epoch in epochs:
        assert sorted(sum(epoch, [])) == list(range(length))
        assert 0.25 < np.mean([i % 2 for i in epoch[0]]) < 0.75, epoch[0]
    assert epochs[0][0] != epochs[1][0]


def test_an_unseeded_shuffle_splits_one_global_permutation_and_moves_ahead_of_maps():
    tf.random.set_seed(None)  # a global seed an earlier test left would seed the shuffle
    dataset = tf.data.Dataset.range(64).map(lambda i: i * 1).shuffle(64).batch(4)
    agreed = _AgreedSeeds(2)
    split = [tf_data.shard_dataset(dataset, 2, r, pad=True, allgather=agreed)[0] for r in range(2)]
    # The shuffle now reads the source: the map runs after the split, on the shard only.
    chain = [n.op for n in tf_data.dataset_graph(split[0]).node if n.op.endswith("Dataset")]
    assert chain.index("ShuffleDataset") < chain.index("ShardDataset") < chain.index("MapDataset")
    assert_global_permutations(_epochs([s.as_numpy_iterator() for s in split], 1)
                               + _epochs([s.as_numpy_iterator() for s in split], 1), 64)


def test_a_shuffle_behind_a_cache_stays_and_shuffles_each_shard():
    tf.random.set_seed(None)
    dataset = tf.data.Dataset.range(16).map(lambda i: i * 1).cache().shuffle(16).batch(4)
    served = _epochs([s.as_numpy_iterator() for s in
                      (tf_data.shard_dataset(dataset, 2, r, pad=True)[0] for r in range(2))], 1)[0]
    assert sorted(served[0]) == list(range(0, 16, 2))  # documented in docs/semantics.md


def test_shuffled_arrays_and_py_datasets_split_one_global_permutation_per_epoch():
    from keras_dist.inputs.position import EpochPosition
    from keras_dist.inputs.arrays import EpochRows

    position = EpochPosition(seed=11)
    ids = np.arange(64)
    rows = [EpochRows({"x": ids, "y": ids, "sample_weight": None}, 2, r, 4, position) for r in range(2)]
    pages = [py_dataset.ShardedPyDataset(_Numbered(64), 2, r, pad=True, position=position, shuffle=True)
             for r in range(2)]
    for shards in (rows, pages):
        epochs = []
        for epoch in range(2):
            position.epoch = epoch
            epochs.append([[int(i) for step in range(s.num_batches) for i in s[step][1]] for s in shards])
        assert_global_permutations(epochs, 64)


class _Numbered(__import__("keras").utils.PyDataset):
    """Batch i is [[i]]: shows which batches a shard serves."""

    def __init__(self, count):
        super().__init__()
        self.count = count

    def __len__(self):
        return self.count

    def __getitem__(self, index):
        return np.array([[index]]), np.array([index])


def _served(dataset):
    return [list(dataset[i][1]) for i in range(dataset.num_batches)]


def test_py_datasets_split_by_batch_index_with_equal_steps():
    numbered = _Numbered(7)
    # Training: shard 1 runs short and takes batch 0 again (fewer than N extra batches).
    assert [_served(py_dataset.ShardedPyDataset(numbered, 2, r, pad=True)) for r in range(2)] == \
        [[[0], [2], [4], [6]], [[1], [3], [5], [0]]]
    # Evaluation: an empty batch instead, which adds nothing to metrics or predictions.
    assert [_served(py_dataset.ShardedPyDataset(numbered, 2, r, pad=False)) for r in range(2)] == \
        [[[0], [2], [4], [6]], [[1], [3], [5], []]]
    # A process feeding two replicas concatenates their batches of each step.
    assert _served(py_dataset.ShardedPyDataset(numbered, 2, 1, pad=False, batch_multiplier=2)) == [[2, 3], [6]]


def test_py_datasets_for_predict_split_into_consecutive_runs_in_rank_order():
    shards = [_served(py_dataset.ShardedPyDataset(_Numbered(7), 2, r, pad=False, contiguous=True)) for r in range(2)]
    assert shards == [[[0], [1], [2], [3]], [[4], [5], [6], []]]


@pytest.mark.parametrize("keras_backend", rotated(["tensorflow", "jax", "torch"], "tensorflow",
                                                   "KERAS_DIST_INPUT_MATRIX"))
def test_every_batched_construction_fits_under_two_processes(tmp_path, keras_backend):
    """Each construction through `fit` under `keras-dist launch -n 2` (Horovod on TensorFlow):
    both ranks run the steps of one process at twice the batch and end with the same weights.
    CI runs TensorFlow's; KERAS_DIST_INPUT_MATRIX=1 runs JAX's and PyTorch's too."""
    pytest.importorskip(keras_backend)
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, WORKERS / "batched_datasets.py", tmp_path], 400,
                       {"KERAS_BACKEND": keras_backend})
    assert code == 0, output[-4000:]
    ranks = [json.loads((tmp_path / f"batched.{rank}.json").read_text()) for rank in range(2)]
    steps = {name: sum(1 for _ in dataset) for name, dataset in
             batched_datasets.constructions(tmp_path / "data", batch=8).items()}
    assert set(ranks[0]) == set(steps)
    for name, count in steps.items():
        first, second = ranks[0][name], ranks[1][name]
        assert first["steps"] == second["steps"] == [count] * 2, (name, count, first["steps"], second["steps"])
        assert first["weights"] == second["weights"] and first["loss"] == second["loss"], name
        assert all(np.isfinite(first["loss"])), name


def test_keras_dist_pipelines_over_arrays_run_without_tf_data_autotuning():
    """The end of an autotuned iterator waits for its tuning thread's next wake-up: each epoch
    of fit began 0.5-1.2 s late where steps leave the core idle, as they do waiting for a
    collective (bench/results/2026-11-28-cpu-2core-epoch-start.md). keras_dist's own
    pipelines over arrays (the epoch's rows gathered per batch; slices where steps are
    collectives) have nothing to tune: both turn it off."""
    from keras_dist.inputs.arrays import EpochBatches, EpochRows, _dataset
    from keras_dist.inputs.position import EpochPosition

    ids = np.arange(16, dtype="float32")
    rows = EpochRows({"x": ids, "y": ids, "sample_weight": None}, 2, 0, 4, EpochPosition(seed=1))
    pipelines = {"epoch rows": EpochBatches(rows).get_tf_dataset(), "slices": _dataset({"x": ids, "y": ids}, 4)}
    for name, dataset in pipelines.items():
        assert dataset.options().autotune.enabled is False, name
        assert len(list(dataset)) == (2 if name == "epoch rows" else 4), name
