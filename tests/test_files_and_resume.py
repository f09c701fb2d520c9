"""Chief-only files and refusing mismatched models (resume after faults: test_fault_matrix.py)."""


import pytest

from runner import WORKERS, horovodrun

import runner


def test_only_the_chief_writes_checkpoints_tensorboard_and_csv(tmp_path):
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", tmp_path, 2], timeout=240)
    assert code == 0, out[-4000:]
    chief = tmp_path / "files.0"
    assert (chief / "model.keras").is_file() and (chief / "best.weights.h5").is_file()
    assert len((chief / "log.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert any((chief / "tensorboard").rglob("events.out.tfevents.*"))
    assert not (tmp_path / "files.1").exists()


@pytest.mark.parametrize("backend", ["horovod", "mwms"])
def test_ranks_with_different_models_fail_fast_with_one_line_error(tmp_path, backend):
    if backend == "horovod":
        outputs = [horovodrun(2, [WORKERS / "mismatched_models.py"], timeout=180)]
    else:
        outputs = runner.run_python([[WORKERS / "mismatched_models.py"]] * 2, runner.tf_config_envs(2), timeout=180)
    for code, out in outputs:
        assert code != 0
        assert "KerasDistError: the model on rank 1 differs from rank 0's" in out
        assert "build the same model" in out
