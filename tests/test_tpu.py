"""TPU backend: which TPU it picks, and the error when there is none (no TPU here)."""


import pytest

import runner

from keras_dist.strategies.tpu import tpu_address  # noqa: E402


def test_address_selection(tmp_path):
    none = (str(tmp_path / "accel*"),)
    assert tpu_address({}, device_globs=none) is None
    assert tpu_address({"TPU_NAME": "my-tpu"}, device_globs=none) == "my-tpu"
    assert tpu_address({"KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS": "grpc://1.2.3.4:8470"}, device_globs=none) == "grpc://1.2.3.4:8470"
    assert tpu_address({"TPU_NAME": "my-tpu"}, requested="other", device_globs=none) == "other"
    (tmp_path / "accel0").touch()
    assert tpu_address({}, device_globs=(str(tmp_path / "accel*"),)) == "local"


def test_detection():
    assert runner.selected_backend({"TPU_NAME": "my-tpu"}) == "tpu"
    assert runner.selected_backend({}) == "single"


@pytest.mark.timeout(300)
def test_requested_without_a_tpu_is_a_one_line_error():
    script = "import keras_dist\ntry:\n    keras_dist.init(backend='tpu')\nexcept keras_dist.KerasDistError as e:\n    print('ERROR:', e)\n"
    ((code, out),) = runner.run_python([["-c", script]], [{"TPU_NAME": "no-such-tpu-anywhere"}], timeout=240)
    line = next(line for line in out.splitlines() if line.startswith("ERROR:"))
    assert "could not reach TPU 'no-such-tpu-anywhere'" in line or "found no TPU" in line
