"""Chief-only files, resume after a crash, and refusing mismatched models (Horovod)."""

import pickle

import numpy as np

from conftest import WORKERS, horovodrun


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


def test_ranks_with_different_models_fail_fast_with_one_line_error(tmp_path):
    code, out = horovodrun(2, [WORKERS / "mismatched_models.py"], timeout=180)
    assert code != 0
    assert "KerasDistError: the model on rank 1 differs from rank 0's" in out
    assert "build the same model" in out
