"""Chief-only files and refusing mismatched models (resume after faults: test_fault_matrix.py)."""


import pytest

from runner import PYTHON, WORKERS, horovodrun, run

import runner

# As where keras_dist is not installed: importing it fails.
LOAD_WITHOUT_KERAS_DIST = """
import sys
sys.modules["keras_dist"] = None
import keras, numpy as np
model = keras.models.load_model(sys.argv[1])
print("steps", int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
      "loss", model.evaluate(np.ones((8, 4), "float32"), np.ones((8, 1), "float32"), verbose=0))
"""


def test_only_the_chief_writes_checkpoints_tensorboard_and_csv(tmp_path):
    code, out = horovodrun(2, [WORKERS / "checkpointing.py", tmp_path, 2], timeout=240)
    assert code == 0, out[-4000:]
    chief = tmp_path / "files.0"
    assert (chief / "model.keras").is_file() and (chief / "best.weights.h5").is_file()
    assert len((chief / "log.csv").read_text().splitlines()) == 3  # header + 2 epochs
    assert any((chief / "tensorboard").rglob("events.out.tfevents.*"))
    assert not (tmp_path / "files.1").exists()
    # The chief's checkpoint of a model compiled by keras_dist is a plain Keras model.
    code, out = run([PYTHON, "-c", LOAD_WITHOUT_KERAS_DIST, chief / "model.keras"], timeout=120)
    assert code == 0, out[-3000:]
    assert "steps 8 loss" in out, out[-3000:]  # 2 epochs of 128 samples at 2 x 16


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
