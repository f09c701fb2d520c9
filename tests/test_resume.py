"""No work lost: a job killed at any step and run again ends as if it had never been killed.

A two-line script with `BackupAndRestore(save_freq=5)` (tests/workers/resume.py) is run
uninterrupted, then killed (SIGKILL) at one step and run again, by `keras-dist launch
--max-restarts 1` or by the test (one process, `horovodrun`, `torchrun`). The rerun must
train exactly the steps after the last backup, in the same order, and end with the
uninterrupted run's weights and logged epoch losses. A preemption notice (SIGTERM to the
launcher or to one task) must end the job with exit 143 within the grace period, the
state saved at the step the tasks agreed on, and the rerun resume there exactly; with
`--backup-dir` the script needs no `BackupAndRestore` of its own.

Run with `-s` to see the seconds from each notice to the job's end.
"""

import time

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
        return [BIN / "keras-dist", "launch", "-n", 2, *argv]
    return runner.configuration_command(configuration, argv) if configuration != "one" else [PYTHON, *argv]


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The uninterrupted run of a (configuration, backend, input), made once for the tests
    that share it. Backed up by the script's BackupAndRestore: where keras_dist orders the
    epochs, the order depends on the seed and the epoch only, not on the backup's schedule."""
    made = {}

    def reference(configuration, backend, data):
        key = (configuration, backend, data)
        if key not in made:
            directory = tmp_path_factory.mktemp("reference")
            code, out = runner.run(command(configuration, [WORKER, directory, data]), 240, {"KERAS_BACKEND": backend})
            assert code == 0, out[-3000:]
            made[key] = directory
        return made[key]

    return reference


def run_killed_and_rerun(directory, configuration, backend, argv):
    """Runs the worker with `argv` (killed at some step), then runs it again."""
    directory.mkdir()
    env = {"KERAS_BACKEND": backend}
    code, out = runner.run(command(configuration, [WORKER, directory, *argv]), 240, env)
    assert code != 0 and (directory / "killed").exists(), out[-3000:]
    code, out = runner.run(command(configuration, [WORKER, directory, *argv]), 240, env)
    assert code == 0, out[-3000:]


def assert_resumed_exactly(reference, killed, restored=None):
    """The rerun resumed after global step `restored`, the last whole backup's (None: wherever
    it resumed), and ended as the uninterrupted run."""
    total = steps(reference)
    restored = len(total) - len(steps(killed, "rerun")) if restored is None else restored
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
    # (Mid-epoch kills of shuffled arrays and DataLoaders: the two-process cases below.)
    ("tensorflow", "tf_data", 30, ("--during-save",), 25),    # during the backup's write; a map read again
    # Due after the epoch's last step, the backup is taken at the epoch's end: the rerun
    # starts the next epoch.
    ("torch", "arrays", 25, ("--save-freq", "4"), 24),
])
def test_one_process_killed_at_any_step_resumes_exactly(tmp_path, references, backend, data, kill_at, extra,
                                                        restored):
    killed = tmp_path / "killed"
    run_killed_and_rerun(killed, "one", backend, [data, "--kill-at", kill_at, *extra])
    assert_resumed_exactly(references("one", backend, data), killed, restored)


# Two processes: 12 steps an epoch.
@pytest.mark.parametrize("configuration, backend, data, kill_at, kill_rank, restored", [
    ("launch_2", "jax", "arrays", 14, 1, 10),                 # restarted by --max-restarts
    ("torchrun_2", "torch", "py_dataset", 14, 1, 10),         # rerun by the test
    ("horovod_2", "tensorflow", "arrays", 17, 0, 15),
])
def test_a_job_killed_mid_epoch_resumes_exactly(tmp_path, references, configuration, backend, data, kill_at,
                                                kill_rank, restored):
    killed = tmp_path / "killed"
    argv = [data, "--kill-at", kill_at, "--kill-rank", kill_rank]
    if configuration == "launch_2":
        killed.mkdir()
        code, out = runner.run([BIN / "keras-dist", "launch", "-n", 2, "--max-restarts", 1, WORKER, killed, *argv],
                               240, {"KERAS_BACKEND": backend})
        assert code == 0, out[-3000:]
    else:
        run_killed_and_rerun(killed, configuration, backend, argv)
    assert_resumed_exactly(references(configuration, backend, data), killed, restored)


@pytest.mark.parametrize("backend, data, notice_to, extra", [
    # The launcher passes the notice on; the script has no BackupAndRestore: --backup-dir's.
    ("jax", "arrays", "launcher", ("--no-backup",)),
    # One task gets it (as the kubelet signals one pod); the others learn it at the next check.
    ("torch", "data_loader", "self", ()),
])
def test_a_preemption_notice_saves_at_an_agreed_step_and_the_rerun_resumes_exactly(tmp_path, references, backend,
                                                                                   data, notice_to, extra):
    noticed = tmp_path / "noticed"
    # Steps slowed so the notice meets steps still to come: checks come about once a second.
    argv = [data, "--step-seconds", "0.1", "--notice-at", 4, "--notice-to", notice_to, "--kill-rank", 1, *extra]
    launch = ["--backup-dir", tmp_path / "backups"] if "--no-backup" in extra else []
    noticed.mkdir()
    env = {"KERAS_BACKEND": backend}
    code, out = runner.run([BIN / "keras-dist", "launch", "-n", 2, *launch, WORKER, noticed, *argv], 240, env)
    seconds = time.time() - float((noticed / "notice").read_text())
    print(f"{backend}: SIGTERM to the {notice_to} at step 4: the job ended {seconds:.1f} s later, exit {code}")
    assert code == 143 and seconds < 30 and "saved in" in out, out[-3000:]
    assert 4 <= len(steps(noticed)) < 36  # stopped at an agreed step after the notice, before the end
    code, out = runner.run([BIN / "keras-dist", "launch", "-n", 2, *launch, WORKER, noticed, *argv], 240, env)
    assert code == 0, out[-3000:]
    assert_resumed_exactly(references("launch_2", backend, data), noticed, len(steps(noticed)))


def test_a_notice_with_nothing_to_save_ends_the_job_and_names_the_option(tmp_path):
    argv = [BIN / "keras-dist", "launch", "-n", 2, WORKER, tmp_path, "arrays", "--no-backup", "--step-seconds",
            "0.05", "--notice-at", 3, "--notice-to", "self", "--kill-rank", 1]
    code, out = runner.run(argv, 240, {"KERAS_BACKEND": "jax"})
    assert code == 143 and "--backup-dir" in out, out[-3000:]
    assert len(steps(tmp_path)) < 36


def test_backup_dir_with_max_restarts_resumes_a_killed_job_exactly(tmp_path, references):
    """SIGKILL mid-epoch, no BackupAndRestore in the script: the backups every
    KERAS_DIST_BACKUP_SECONDS and at each epoch's end are enough."""
    killed = tmp_path / "killed"
    killed.mkdir()
    argv = [BIN / "keras-dist", "launch", "-n", 2, "--max-restarts", 1, "--backup-dir", tmp_path / "backups", WORKER,
            killed, "data_loader", "--no-backup", "--step-seconds", "0.05", "--kill-at", 17, "--kill-rank", 1]
    code, out = runner.run(argv, 240, {"KERAS_BACKEND": "torch", "KERAS_DIST_BACKUP_SECONDS": "0.2"})
    assert code == 0, out[-3000:]
    reference = references("launch_2", "torch", "data_loader")
    assert 12 <= len(steps(reference)) - len(steps(killed, "rerun")) <= 17
    assert_resumed_exactly(reference, killed)


def trained_samples(directory, attempt, epoch, before_step=None):
    """The sample ids every rank trained in `epoch` (before step `before_step`), from the worker's records."""
    ids = []
    for path in sorted(directory.glob(f"samples.{attempt}.*")):
        for line in path.read_text().splitlines():
            record_epoch, step, *samples = map(int, line.split())
            if record_epoch == epoch and (before_step is None or step < before_step):
                ids += samples
    return sorted(ids)


@pytest.mark.parametrize("first, rerun, kill_at, epoch, steps_done", [
    ("launch_2", "one", 14, 0, 10),   # 2 -> 1: the backup after 10 of epoch 1's 12 steps
    ("one", "launch_2", 30, 1, 6),    # 1 -> 2: after 6 of epoch 2's 24 steps
])
def test_a_backup_restores_on_another_process_count_training_each_sample_once(tmp_path, first, rerun, kill_at,
                                                                             epoch, steps_done):
    """The batch size per replica stays; the rest of the interrupted epoch's order is split
    among the processes of the rerun, so no sample is skipped or trained twice (by ids)."""
    argv = [WORKER, tmp_path, "arrays", "--record-samples", "--kill-at", kill_at]
    env = {"KERAS_BACKEND": "torch"}
    code, out = runner.run(command(first, argv), 240, env)
    assert code != 0 and (tmp_path / "killed").exists(), out[-3000:]
    code, out = runner.run(command(rerun, argv), 240, env)
    assert code == 0, out[-3000:]
    everything = list(range(96))
    assert sorted(trained_samples(tmp_path, "first", epoch, steps_done) +
                  trained_samples(tmp_path, "rerun", epoch)) == everything
    for later in range(epoch + 1, EPOCHS):
        assert trained_samples(tmp_path, "rerun", later) == everything
