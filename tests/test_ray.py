"""Ray Train as the engine that starts the processes (issue 54): the unchanged two-line script,
run inside a Ray Train trainer's training function on a local Ray cluster of two nodes,
trains as one job, and a worker killed mid-epoch is started again by Ray's `FailureConfig`
and resumes exactly from the script's `BackupAndRestore`.

Ray is not among the test set-up's packages: the first run installs the version below into
.cache/ray-site (about 80 MB; only what the test environment lacks, so TensorFlow keeps its
own protobuf and NumPy), and the tests skip in one line where it cannot be installed.
"""

import json
import os
import shutil
import tempfile

import pytest

from runner import BIN, PYTHON, ROOT, WORKERS, run
from test_resume import WORKER as RESUME_SCRIPT
from test_resume import assert_resumed_exactly

pytestmark = pytest.mark.timeout(900)
RAY_VERSION = "2.60.0"
RAY_SITE = ROOT / ".cache" / "ray-site"


def install_ray() -> None:
    """Ray and what it needs that the test environment lacks, into RAY_SITE (kept for later runs)."""
    staging = tempfile.mkdtemp(prefix="ray-site-", dir=RAY_SITE.parent)
    try:
        report = os.path.join(staging, "report.json")
        code, out = run([PYTHON, "-m", "pip", "install", "--quiet", "--dry-run", "--report", report,
                         f"ray[train]=={RAY_VERSION}"], 600)
        if code != 0:
            pytest.skip(f"ray {RAY_VERSION} cannot be installed here: {out.strip().splitlines()[-1:]}")
        with open(report) as f:
            missing = [f"{p['metadata']['name']}=={p['metadata']['version']}" for p in json.load(f)["install"]]
        code, out = run([PYTHON, "-m", "pip", "install", "--quiet", "--no-deps", "--target",
                         os.path.join(staging, "site"), *missing], 600)
        if code != 0:
            pytest.skip(f"ray {RAY_VERSION} cannot be installed here: {out.strip().splitlines()[-1:]}")
        os.replace(os.path.join(staging, "site"), RAY_SITE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


@pytest.fixture(scope="module")
def ray_site():
    RAY_SITE.parent.mkdir(exist_ok=True)
    if not (RAY_SITE / "ray" / "__init__.py").exists():
        install_ray()
    return RAY_SITE


def run_under_ray(out, trainer, keras_backend, script_arguments):
    """Runs tests/workers/ray_train.py (its cluster, its trainer) under a hard timeout, then
    stops whatever Ray left running."""
    ray_directory = tempfile.mkdtemp(prefix="kd-ray-", dir="/tmp")  # short: Ray keeps sockets there
    env = {"KERAS_BACKEND": keras_backend, "PYTHONPATH": f"{ROOT}:{RAY_SITE}", "RAY_TMPDIR": ray_directory,
           "RAY_USAGE_STATS_ENABLED": "0",
           # Else `ray.init` trades 127.0.0.1 for the machine's outward address and waits for it.
           "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    try:
        return run([PYTHON, WORKERS / "ray_train.py", out, trainer, RESUME_SCRIPT, *script_arguments], 600, env)
    finally:
        run([PYTHON, RAY_SITE / "bin" / "ray", "stop", "--force"], 120, env)
        shutil.rmtree(ray_directory, ignore_errors=True)


@pytest.mark.parametrize("trainer, keras_backend", [("torch", "torch"), ("jax", "jax")])
def test_a_ray_train_worker_killed_mid_epoch_is_started_again_by_ray_and_resumes_exactly(
        tmp_path, ray_site, trainer, keras_backend):
    pytest.importorskip(keras_backend)
    reference = tmp_path / "reference"
    reference.mkdir()
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, RESUME_SCRIPT, reference, "arrays"], 240,
                    {"KERAS_BACKEND": keras_backend})
    assert code == 0, out[-3000:]
    killed = tmp_path / "killed"
    killed.mkdir()
    # 12 steps an epoch on 2 workers, a backup every 5: rank 1 dies after global step 14.
    code, out = run_under_ray(killed, trainer, keras_backend, [killed, "arrays", "--kill-at", 14, "--kill-rank", 1])
    assert code == 0, out[-4000:]
    report = json.loads((killed / "ray.json").read_text())
    assert report["error"] is None, out[-4000:]
    assert (killed / "killed").exists(), "rank 1 was not killed"
    assert "2 replicas in 2 processes on 1 machine (cluster environment: ray_train)" in out, out[-3000:]
    assert_resumed_exactly(reference, killed, restored=10)
