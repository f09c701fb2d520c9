"""Keras's guides for JAX and PyTorch, unchanged but for the two lines (tests/workers/keras_guides.py).

Each Keras backend runs every pattern as one plain process at the global batch (the
reference), with keras_dist in one process, and as 2 processes under `keras-dist
launch` (plus `torchrun` for PyTorch). Seeded patterns must end where the reference
does; unseeded ones must agree on every rank, with the frozen layer unmoved. The
transfer-learning recipe also runs under Horovod and MultiWorkerMirrored.
"""


import numpy as np
import pytest

from runner import BIN, WORKERS, configuration_command, load_results, run, run_many
from test_published_patterns import assert_close, assert_learns_like_one_process, assert_reloads_the_best_and_callback_files

pytestmark = pytest.mark.timeout(900)
SCRIPT = WORKERS / "keras_guides.py"
# Unseeded patterns first: a seeded one leaves the script seeded for the rest.
UNSEEDED = ["unseeded_transfer_learning", "unseeded_dataloader_shuffled"]
SEEDED = ["seeded_custom_train_step", "seeded_metric_objects", "seeded_sum_metrics", "seeded_second_model", "seeded_evaluate_unfitted",
          "seeded_dataloader", "seeded_structured_inputs", "seeded_generator",
          "seeded_fewer_samples_than_processes"]
# Last: it seeds. Shuffled, so another order than one process's, but as much learned.
PATTERNS = [*UNSEEDED, "unseeded_iterable_dataset", *SEEDED, "alternating_labels",
            "checkpoint_reload_and_callback_files"]
# Input structures and sizes (tests/test_input_matrix.py splits them all in one process).
STRUCTURES = ["seeded_structured_inputs", "seeded_generator", "seeded_fewer_samples_than_processes"]
CONFIGURATIONS = {"jax": ["plain_1", "keras_dist_1", "launch_2"], "torch": ["plain_1", "keras_dist_1", "launch_2", "torchrun_2"]}


def run_patterns(configurations, keras_backend, directory, patterns, timeout=400):
    """Runs the worker under each configuration, all at once; returns {configuration: {pattern: [result per rank]}}."""
    directories = {name: directory / name for name in configurations}
    commands = []
    for name in configurations:
        directories[name].mkdir()
        mode = "plain" if name == "plain_1" else "keras_dist"
        commands.append(configuration_command(name, [SCRIPT, directories[name], mode, *patterns]))
    outputs = run_many(commands, timeout, [{"KERAS_BACKEND": keras_backend}] * len(commands))
    results = {}
    for name, (code, output) in zip(configurations, outputs):
        assert code == 0, f"{name}:\n{output[-5000:]}"
        ranks = int(name.rsplit("_", 1)[1])
        results[name] = {pattern: load_results(directories[name], pattern, ranks) for pattern in patterns}
    return results


@pytest.fixture(scope="module", params=sorted(CONFIGURATIONS))
def guides(request, tmp_path_factory):
    """(Keras backend, {configuration: {pattern: [result per rank]}})."""
    keras_backend = request.param
    pytest.importorskip(keras_backend)
    pytest.importorskip("torch")  # the DataLoader patterns, on every Keras backend
    return keras_backend, run_patterns(CONFIGURATIONS[keras_backend], keras_backend,
                                       tmp_path_factory.mktemp(keras_backend), PATTERNS)


def test_seeded_guides_match_one_plain_process_at_the_global_batch(guides):
    keras_backend, results = guides
    for configuration in CONFIGURATIONS[keras_backend][1:]:
        for pattern in SEEDED:
            reference = results["plain_1"][pattern][0]
            for rank, result in enumerate(results[configuration][pattern]):
                assert "refused" not in result, result.get("refused")
                assert_close(result, reference, f"{keras_backend} {configuration} rank {rank} {pattern}")


def test_shuffled_shards_learn_what_one_process_learns(guides):
    keras_backend, results = guides
    for configuration in CONFIGURATIONS[keras_backend][1:]:
        assert_learns_like_one_process(results, configuration)


def test_every_rank_reloads_the_best_checkpoint_and_callback_files_are_the_chiefs(guides):
    keras_backend, results = guides
    for configuration in CONFIGURATIONS[keras_backend]:
        assert_reloads_the_best_and_callback_files(results, configuration)


def test_unseeded_guides_start_alike_and_keep_a_frozen_layer_frozen(guides):
    keras_backend, results = guides
    for configuration in CONFIGURATIONS[keras_backend][1:]:
        for pattern in UNSEEDED:
            first, *others = results[configuration][pattern]
            assert "refused" not in first, first.get("refused")
            for rank, other in enumerate(others, 1):
                other, first = ({k: v for k, v in r.items() if k != "seen"} for r in (other, first))
                assert_close(other, first, f"{keras_backend} {configuration} rank {rank} {pattern}", tolerance=1e-6)
        assert not results[configuration]["unseeded_transfer_learning"][0]["frozen_moved"], configuration


def test_a_shuffling_data_loader_gives_each_replica_its_share_of_one_permutation(guides):
    keras_backend, results = guides
    everything = sorted(results["plain_1"]["unseeded_dataloader_shuffled"][0]["seen"][0][-70:])
    for configuration in CONFIGURATIONS[keras_backend][2:]:
        ranks = [r["seen"] for r in results[configuration]["unseeded_dataloader_shuffled"]]
        for epoch in range(2):  # each epoch's last 35 reads (Keras reads a first batch to build the model)
            shares = [seen[epoch][-35:] for seen in ranks]
            assert sorted(shares[0] + shares[1]) == everything, (configuration, epoch)
        assert ranks[0][0][-35:] != ranks[0][1][-35:]  # a new permutation each epoch


def test_an_iterable_dataset_is_refused_in_one_line_under_two_processes_only(guides):
    keras_backend, results = guides
    assert "refused" not in results["keras_dist_1"]["unseeded_iterable_dataset"][0]
    for configuration in CONFIGURATIONS[keras_backend][2:]:
        message = results[configuration]["unseeded_iterable_dataset"][0]["refused"]
        assert "IterableDataset" in message and "\n" not in message, message


def test_tensorflow_strategies_keep_a_frozen_base_frozen_split_or_refuse_a_data_loader_and_take_structures(tmp_path):
    pytest.importorskip("torch")
    runs = run_patterns(["plain_1", "horovod_2", "mwms_2"], "tensorflow", tmp_path,
                        ["unseeded_transfer_learning", "seeded_dataloader", *STRUCTURES])
    reference = runs.pop("plain_1")
    for configuration, results in runs.items():
        for pattern in STRUCTURES:
            for rank, result in enumerate(results[pattern]):
                expected = reference[pattern][0]
                if configuration == "mwms_2" and pattern == "seeded_generator":  # its steps are collectives
                    assert "cannot split a Python generator" in result["refused"] and "\n" not in result["refused"]
                    continue
                if configuration == "mwms_2" and pattern == "seeded_fewer_samples_than_processes":
                    # no generator or DataLoader where steps are collectives
                    expected = {k: v for k, v in expected.items() if k.split("_")[0] in ("arrays", "py", "tf")}
                assert_close(result, expected, f"{configuration} rank {rank} {pattern}")
        first, second = results["unseeded_transfer_learning"]
        assert not first["frozen_moved"] and not second["frozen_moved"]
        assert_close(second, first, configuration, tolerance=1e-6)
        assert all(np.isfinite(w).all() for w in first["weights"])
        # A DataLoader: split under Horovod; refused in one line where every step is a collective.
        loader = results["seeded_dataloader"]
        if configuration == "mwms_2":
            assert all("cannot read a torch DataLoader" in r["refused"] and "\n" not in r["refused"] for r in loader)
        else:
            assert "refused" not in loader[0], loader[0]
            assert_close(loader[1], loader[0], configuration, tolerance=1e-6)


def test_the_fit_start_broadcast_reports_ranks_whose_weights_differed(tmp_path):
    """With the job's seed the weights agree before fit; a script seeding each rank apart is told."""
    script = tmp_path / "seeds.py"
    script.write_text(
        "import logging, sys\n"
        "import keras, numpy as np\n"
        "import keras_dist\n"
        "logging.basicConfig(level=logging.INFO, format='%(message)s')\n"
        "def train(name):\n"
        "    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])\n"
        "    keras_dist.compile(model, optimizer='sgd', loss='mse')\n"
        "    print('fitting', name, flush=True)\n"
        "    model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=2, verbose=0)\n"
        "    sys.stderr.flush()\n"
        "train('shared')\n"
        "keras.utils.set_random_seed(keras_dist.current().rank)\n"
        "train('apart')\n"
        "print('done', flush=True)\n"
    )
    # PyTorch: under JAX's multi-process distribution Keras itself refuses unequal new variables.
    pytest.importorskip("torch")
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, script], 300, env={"KERAS_BACKEND": "torch"})
    assert code == 0, output[-3000:]
    shared, apart = output.split("fitting apart", 1)
    assert "differed from the chief's" not in shared, shared[-2000:]
    assert "rank(s) [1] differed from the chief's" in apart, apart[-2000:]


def test_three_processes_evaluate_and_predict_fewer_samples_than_processes_as_one(tmp_path):
    """1 and 3 samples on 3 processes: two ranks, then none, have a share of their own."""
    pytest.importorskip("torch")
    pattern = "seeded_fewer_samples_than_processes"
    runs = run_patterns(["plain_1", "launch_3"], "jax", tmp_path, [pattern])
    for rank in range(3):
        assert_close(runs["launch_3"][pattern][rank], runs["plain_1"][pattern][0], f"launch_3 rank {rank}")
