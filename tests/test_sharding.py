"""Sharded optimizer state (`keras_dist.compile(..., shard="optimizer")`, issue 57): each of N
processes keeps Adam's moments for about 1/N of the variables, and the job trains as the
unsharded one, and as one process at the global batch."""

import json

import pytest

from runner import PYTHON, WORKERS, assert_trains_like, configuration_command, run

pytestmark = pytest.mark.timeout(600)
WORKER = WORKERS / "any_backend_worker.py"


def train(out, configuration, keras_backend, *arguments):
    out.mkdir()
    code, output = run(configuration_command(configuration, [WORKER, out, *arguments]), 300,
                       {"KERAS_BACKEND": keras_backend})
    return code, output


def results(out, processes):
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(processes)]


def test_two_torch_processes_with_sharded_adam_train_as_one_at_the_global_batch_with_half_the_state(tmp_path):
    pytest.importorskip("torch")
    common = ["--adam", "--global-clipnorm", "0.5", "--samples", 64, "--epochs", 2]
    code, output = train(tmp_path / "reference", "keras_dist_1", "torch", "--batch", 16, *common)
    assert code == 0, output[-3000:]
    (reference,) = results(tmp_path / "reference", 1)
    code, output = train(tmp_path / "unsharded", "torchrun_2", "torch", "--batch", 8, *common)
    assert code == 0, output[-3000:]
    unsharded = results(tmp_path / "unsharded", 2)
    code, output = train(tmp_path / "sharded", "torchrun_2", "torch", "--batch", 8, "--shard", "optimizer", *common)
    assert code == 0, output[-3000:]
    sharded = results(tmp_path / "sharded", 2)
    for result in sharded:
        assert_trains_like(result, reference)
    # Adam's moments split over the two ranks (by bytes: the first kernel's 20 weights on rank 0,
    # the other 9 on rank 1), plus each rank's own iteration count and learning rate.
    whole = unsharded[0]["optimizer_state_bytes"]
    shares = [r["optimizer_state_bytes"] for r in sharded]
    assert all(share < whole for share in shares) and sum(shares) == whole + 8, (shares, whole)


@pytest.mark.parametrize("case, arguments, error", [
    ("checkpoint", ["--callbacks"], "ModelCheckpoint: a model compiled with shard='optimizer' cannot be saved yet"),
])
def test_what_sharded_state_cannot_do_yet_is_one_line_on_every_process(tmp_path, case, arguments, error):
    pytest.importorskip("torch")
    code, output = train(tmp_path / case, "launch_2", "torch", "--shard", "optimizer", *arguments)
    assert code != 0 and output.count(f"KerasDistError: {error}") == 2, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_backend_that_cannot_shard_says_so_in_one_line(tmp_path):
    pytest.importorskip("jax")
    code, output = train(tmp_path / "jax", "launch_2", "jax", "--shard", "optimizer")
    assert code != 0 and "backend 'jax' cannot shard the optimizer's state yet" in output, output[-3000:]
