"""Chief-only files, resume after a crash, and refusing mismatched models (Horovod; resume
under MultiWorkerMirroredStrategy too)."""

import pickle
import sys

import numpy as np
import pytest

from conftest import WORKERS, horovodrun

sys.path.insert(0, str(WORKERS))
import runner  # noqa: E402


def load(directory, rank):
    with open(directory / f"result.{rank}.pkl", "rb") as f:
        return pickle.load(f)


def test_only_the_chief_writes_checkpoints_tensorboard_and_csv(tmp_path):
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", tmp_path, 2], timeout=240)
    assert code == 0, out[-4000:]
    chief = tmp_path / "files.0"
    assert (chief / "model.keras").is_file() and (chief / "best.weights.h5").is_file()
    assert len((chief / "log.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert any((chief / "tensorboard").rglob("events.out.tfevents.*"))
    assert not (tmp_path / "files.1").exists()


def test_rerun_after_crash_resumes_every_rank_without_losing_an_epoch(tmp_path):
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", uninterrupted, 4], timeout=240)
    assert code == 0, out[-4000:]

    crashed = tmp_path / "crashed"
    crashed.mkdir()
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", crashed, 4, 1], timeout=240)
    assert code != 0  # both ranks died after epoch 1's backup
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", crashed, 4], timeout=240)
    assert code == 0, out[-4000:]
    for rank in (0, 1):
        resumed = load(crashed, rank)
        assert resumed["epochs_run"] == [2, 3]  # epochs 0 and 1 completed before the crash
        # Same end point as never crashing: weights and Adam's moments were restored.
        reference = load(uninterrupted, rank)["weights"]
        for a, b in zip(resumed["weights"], reference):
            np.testing.assert_allclose(a, b, atol=1e-6)


def mwms_checkpointing(directory, *args):
    """Runs checkpointing.py as 2 MultiWorkerMirroredStrategy workers; returns their `(code, output)`s."""
    argv = [WORKERS / "checkpointing.py", directory, *args]
    return runner.run([argv, argv], runner.tf_config_envs(2))


@pytest.fixture(scope="module")
def mwms_uninterrupted(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mwms_uninterrupted")
    for code, out in mwms_checkpointing(directory, 4):
        assert code == 0, out[-4000:]
    return directory


@pytest.mark.timeout(600)
@pytest.mark.parametrize("crashing", [None, 0, 1], ids=["every_worker", "chief_only", "other_worker_only"])
def test_mwms_rerun_after_crash_resumes_every_worker_without_losing_an_epoch(tmp_path, mwms_uninterrupted, crashing):
    outputs = mwms_checkpointing(tmp_path, 4, 1, *([] if crashing is None else [crashing]))
    for rank, (code, out) in enumerate(outputs):
        if crashing in (None, rank):
            assert code == 3, out[-4000:]
        else:
            # Not left hanging in epoch 2's first all-reduce: TensorFlow aborts the collective
            # (socket closed by a dead chief, or missed heartbeats of a dead worker).
            assert code != 0 and "UnavailableError" in out, out[-4000:]
    for code, out in mwms_checkpointing(tmp_path, 4):
        assert code == 0, out[-4000:]
    for rank in (0, 1):
        resumed = load(tmp_path, rank)
        assert resumed["epochs_run"] == [2, 3]  # the chief's backup of epoch 1, on every worker
        for a, b in zip(resumed["weights"], load(mwms_uninterrupted, rank)["weights"]):
            np.testing.assert_allclose(a, b, atol=1e-6)
    assert not (tmp_path / "files.1").exists()  # the other worker wrote to a scratch directory


@pytest.mark.parametrize("backend", ["horovod", "mwms"])
def test_ranks_with_different_models_fail_fast_with_one_line_error(tmp_path, backend):
    if backend == "horovod":
        outputs = [horovodrun(2, [WORKERS / "mismatched_models.py"], timeout=180)]
    else:
        outputs = runner.run([[WORKERS / "mismatched_models.py"]] * 2, runner.tf_config_envs(2), timeout=180)
    for code, out in outputs:
        assert code != 0
        assert "KerasDistError: the model on rank 1 differs from rank 0's" in out
        assert "build the same model" in out
