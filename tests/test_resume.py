"""No work lost: a job killed at any step and run again ends as if it had never been killed.

A two-line script with `BackupAndRestore(save_freq=5)` (tests/workers/resume.py) is run
uninterrupted, then killed (SIGKILL) at one step and run again, by `keras-dist launch
--max-restarts 1` or by the test (one process, `horovodrun`, `torchrun`). The rerun must
train exactly the steps after the last backup, in the same order, and end with the
uninterrupted run's weights and logged epoch losses.
"""

import numpy as np
import pytest

import runner
from runner import BIN, PYTHON, WORKERS

pytestmark = pytest.mark.timeout(300)
WORKER = WORKERS / "resume.py"
EPOCHS = 3


def steps(directory, attempt="first"):
    path = directory / f"steps.{attempt}"
    return path.read_text().splitlines() if path.exists() else []


def command(configuration, argv):
    if configuration == "launch_2":
        return [BIN / "keras-dist", "launch", "-n", 2, "--max-restarts", 1, *argv]
    return runner.configuration_command(configuration, [WORKER, *argv[1:]]) if configuration != "one" else \
        [PYTHON, *argv]


def run_killed_and_rerun(tmp_path, configuration, backend, data, kill_at, kill_rank=0, extra=()):
    env = {"KERAS_BACKEND": backend}
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    code, out = runner.run(command(configuration, [WORKER, reference, data, *extra]), 240, env)
    assert code == 0, out[-3000:]
    argv = [WORKER, killed, data, "--kill-at", kill_at, "--kill-rank", kill_rank, *extra]
    code, out = runner.run(command(configuration, argv), 240, env)
    if configuration != "launch_2":  # the launcher restarted the job itself
        assert code != 0 and (killed / "killed").exists(), out[-3000:]
        code, out = runner.run(command(configuration, argv), 240, env)
    assert code == 0, out[-3000:]
    return reference, killed


def assert_resumed_exactly(reference, killed, restored):
    """The rerun resumed after global step `restored`, the last whole backup's, as uninterrupted."""
    total = steps(reference)
    assert len(total) == EPOCHS * int(total[-1].split()[1]) + EPOCHS
    assert len(steps(killed)) >= restored
    # The rerun trains exactly the steps after the last backup, in their places.
    assert steps(killed, "rerun") == total[restored:]
    expected, resumed = np.load(reference / "result.npz"), np.load(killed / "result.npz")
    for name in expected.files:
        if name != "loss":
            np.testing.assert_allclose(resumed[name], expected[name], atol=1e-6, err_msg=name)
    # The epochs the rerun logs, the interrupted one included, as uninterrupted.
    np.testing.assert_allclose(resumed["loss"], expected["loss"][-len(resumed["loss"]):], rtol=1e-6)


# One process: 24 steps an epoch, a backup every 5 steps (every 4 with --save-freq 4).
@pytest.mark.parametrize("backend, data, kill_at, extra, restored", [
    ("jax", "arrays", 30, (), 30),                            # mid-epoch, shuffled arrays
    ("torch", "data_loader", 30, (), 30),                     # a shuffling DataLoader
    ("tensorflow", "tf_data", 25, (), 25),                    # the first step of an epoch; a map read again
    ("jax", "py_dataset", 30, ("--during-save",), 25),        # during the backup's write
    # Due after the epoch's last step, the backup is taken at the epoch's end: the rerun
    # starts the next epoch.
    ("torch", "arrays", 25, ("--save-freq", "4"), 24),
])
def test_one_process_killed_at_any_step_resumes_exactly(tmp_path, backend, data, kill_at, extra, restored):
    reference, killed = run_killed_and_rerun(tmp_path, "one", backend, data, kill_at, extra=extra)
    assert_resumed_exactly(reference, killed, restored)


# Two processes: 12 steps an epoch.
@pytest.mark.parametrize("configuration, backend, data, kill_at, kill_rank, restored", [
    ("launch_2", "jax", "arrays", 14, 1, 10),
    ("launch_2", "torch", "data_loader", 17, 0, 15),
    ("torchrun_2", "torch", "py_dataset", 14, 1, 10),
    ("horovod_2", "tensorflow", "arrays", 14, 1, 10),
])
def test_a_job_killed_mid_epoch_resumes_exactly(tmp_path, configuration, backend, data, kill_at, kill_rank, restored):
    reference, killed = run_killed_and_rerun(tmp_path, configuration, backend, data, kill_at, kill_rank)
    assert_resumed_exactly(reference, killed, restored)
