"""Horovod backend: real horovodrun over Gloo on 127.0.0.1, 2 ranks vs 1 process.

All scenarios (tests/workers/horovod_scenarios.py) run in one 2-rank job and one plain
process at twice the batch; the tests below compare what they saved.
"""

import json
import math
import re
from collections import Counter

import numpy as np
import pytest

from runner import PYTHON, WORKERS, horovodrun, load_results, run

SCENARIOS = [
    "sgd_arrays", "sgd_dataset", "dataset_map_shuffled", "sgd_plain", "sum_reduction", "fp16_compression", "adam_schedule",
    "user_optimizer", "global_clipnorm", "gradient_accumulation", "loss_scale", "uneven_shards",
    "evaluate_predict", "learning_rate_scaling", "batch_logs", "unreduced_optimizer",
]
EQUIVALENT = ["sgd_arrays", "sgd_dataset", "dataset_map_shuffled", "sgd_plain", "adam_schedule", "user_optimizer", "global_clipnorm",
              "gradient_accumulation", "loss_scale"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    two, one = tmp_path_factory.mktemp("two_ranks"), tmp_path_factory.mktemp("one_process")
    # Buckets of 256 bytes: every scenario's gradients travel in several collectives.
    code, out = horovodrun(2, [WORKERS / "horovod_scenarios.py", two, *SCENARIOS], timeout=480,
                           env={"KERAS_DIST_BUCKET_BYTES": "256"})
    assert code == 0, out[-5000:]
    code, out = run([PYTHON, WORKERS / "horovod_scenarios.py", one, *SCENARIOS], timeout=300)
    assert code == 0, out[-5000:]
    return lambda name: (load_results(two, name, 2), load_results(one, name, 1)[0])


def max_difference(a, b):
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


@pytest.mark.parametrize("scenario", EQUIVALENT)
def test_two_ranks_at_batch_b_match_one_process_at_2b(runs, scenario):
    (rank0, rank1), single = runs(scenario)
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert max_difference(rank0["weights"], single["weights"]) < 1e-5


def test_training_moved_the_weights(runs):
    # Guards the equivalence test against a model that does not train at all.
    (rank0, _), _ = runs("sgd_plain")
    assert rank0["history"]["loss"][-1] < rank0["history"]["loss"][0]


def test_sum_reduction_at_lr_over_n_equals_mean_at_lr(runs):
    (rank0, rank1), _ = runs("sum_reduction")
    _, single = runs("sgd_plain")
    assert max_difference(rank0["weights"], single["weights"]) < 1e-5


def test_fp16_compression_stays_close_and_in_sync(runs):
    (rank0, rank1), _ = runs("fp16_compression")
    _, single = runs("sgd_plain")
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0
    assert 0 < max_difference(rank0["weights"], single["weights"]) < 1e-2  # rounded, not skipped


def test_epoch_logs_are_global_and_identical_on_every_rank(runs):
    (rank0, rank1), single = runs("sgd_arrays")
    assert rank0["history"] == rank1["history"]
    assert set(rank0["history"]) == {"loss", "accuracy", "val_loss", "val_accuracy"}
    for key, values in single["history"].items():
        np.testing.assert_allclose(rank0["history"][key], values, atol=1e-5)


def test_epoch_logs_are_global_without_a_batch_log_reader(runs):
    (rank0, rank1), single = runs("dataset_map_shuffled")  # no callback: steps keep metric states local
    assert rank0["history"] == rank1["history"]
    for key, values in single["history"].items():
        np.testing.assert_allclose(rank0["history"][key], values, atol=1e-5)


def test_batch_logs_are_global_where_a_callback_reads_them(runs):
    # The model was fit once before without a reader: its train function is traced again.
    (rank0, rank1), single = runs("batch_logs")
    assert len(rank0["batch_losses"]) == 256 // 32
    assert rank0["batch_losses"] == rank1["batch_losses"]
    np.testing.assert_allclose(rank0["batch_losses"], single["batch_losses"], atol=1e-5)


def test_uneven_shards_run_the_same_number_of_steps(runs):
    (rank0, rank1), single = runs("uneven_shards")
    assert rank0["steps"] == rank1["steps"] == single["steps"] == math.ceil(101 / 32)
    assert max_difference(rank0["weights"], rank1["weights"]) == 0.0


def test_evaluate_and_predict_are_global_on_every_rank(runs):
    ranks, single = runs("evaluate_predict")
    for rank in ranks:
        for key in ("evaluate", "evaluate_dataset"):
            assert rank[key].keys() == single[key].keys()
            for metric, value in single[key].items():
                assert rank[key][metric] == pytest.approx(value, abs=1e-6)
        np.testing.assert_allclose(rank["predict"], single["predict"], atol=1e-6)
        np.testing.assert_allclose(rank["predict_dataset"], single["predict_dataset"], atol=1e-6)
        assert rank["predict"].shape == (101, 3)


def test_learning_rate_scaled_by_size_after_linear_warmup(runs):
    (rank0, rank1), single = runs("learning_rate_scaling")
    steps_per_epoch = 256 // 32
    ramp = rank0["lrs"][:steps_per_epoch]
    np.testing.assert_allclose(ramp, [0.1 + 0.1 * i / steps_per_epoch for i in range(steps_per_epoch)], rtol=1e-5)
    np.testing.assert_allclose(rank0["lrs"][steps_per_epoch:], 0.2, rtol=1e-6)
    assert rank0["lrs"] == rank1["lrs"]
    np.testing.assert_allclose(single["lrs"], 0.1, rtol=1e-6)  # one replica: nothing to scale


def test_gradient_accumulation_communicates_once_per_update(tmp_path):
    timeline = tmp_path / "timeline.json"
    code, out = horovodrun(2, [WORKERS / "horovod_scenarios.py", tmp_path, "gradient_accumulation"], timeout=240,
                           env={"HOROVOD_TIMELINE": str(timeline)})
    assert code == 0, out[-4000:]
    (rank0,) = load_results(tmp_path, "gradient_accumulation", 1)
    events = json.loads(timeline.read_text())
    tensor_names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name" and "name" in e["args"]}
    negotiations = Counter(tensor_names[e["pid"]] for e in events if e.get("ph") == "B" and e["name"].startswith("NEGOTIATE"))
    # Gradients are reduced inside the optimizer's name scope ("sgd"), each its own collective by default.
    gradients = {name: count for name, count in negotiations.items() if re.search(r"/sgd(_\d+)?/", name)}
    assert rank0["steps"] == 16  # micro-batches
    assert len(gradients) == 4  # 4 variables
    assert set(gradients.values()) == {16 // 2}  # once per applied update


def test_replicas_that_diverge_stop_after_the_first_epoch_in_one_line(runs):
    ranks, single = runs("unreduced_optimizer")
    assert single["error"] is None  # one process: nothing to compare
    for rank in ranks:
        assert rank["error"].startswith("after epoch 1 the trainable weights of worker(s) [1] differ from the chief's")
        assert "\n" not in rank["error"]


def test_each_gradient_bucket_is_a_collective_of_its_own_that_waits_for_no_other():
    """Overlap: in the traced step, each bucket's all-reduce depends on its own gradients
    only, so TensorFlow starts it while the rest of the backward pass runs."""
    code, out = run([PYTHON, WORKERS / "overlap_graph.py"], timeout=120, env={"KERAS_DIST_BUCKET_BYTES": "10000"})
    assert code == 0, out[-3000:]
    collectives = json.loads(out.split("COLLECTIVES ", 1)[1].split(" LIMIT")[0])
    # Last layers first; a bucket closes once it reaches the limit (16384 B reach it).
    assert [c["bytes"] for c in collectives] == [4 + 256 + 256 + 16384, 256 + 2048]
    assert not any(c["waits_for_another"] for c in collectives)
