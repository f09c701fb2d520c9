"""Keras's own test files, run with the compiles they make routed through `keras_dist.compile`.

The installed keras ships its tests (`keras/src/**/*_test.py`). Each run below is a real
pytest of a selection of them, with the plugin in tests/keras_suites/routing.py loaded, on
one Keras backend, as one plain process or under that backend's launcher with one process
(so that the distributed strategy, not `single`, runs Keras's expectations). A test that
passes without keras_dist must pass with it; the ones that cannot are listed, with why, in
tests/keras_suites/expected_failures.txt, deselected, and printed in the run's summary.

Selection, for the suite's time budget (all of `trainers/trainer_test.py`, `callbacks/` and
`models/` on every backend would exceed it several times over): the trainer's tests and the
callbacks that save, restore or read logs, on JAX in one process; those callbacks under each
backend's launcher with one process. The `grain` cases are left out (grain is not installed).
"""

import re
from pathlib import Path

import keras
import pytest

from runner import BIN, PYTHON, ROOT, horovodrun_command, run

pytestmark = pytest.mark.timeout(900)
KERAS_TESTS = Path(keras.__file__).parent / "src"
EXPECTED = ROOT / "tests" / "keras_suites" / "expected_failures.txt"
CALLBACKS = [f"callbacks/{name}_test.py" for name in ("backup_and_restore", "model_checkpoint", "early_stopping",
                                                     "reduce_lr_on_plateau", "csv_logger", "swap_ema_weights")]
# (Keras backend, launcher, the strategy that must run, files)
RUNS = [
    ("jax", "plain", "single", ["trainers/trainer_test.py", *CALLBACKS]),
    ("jax", "keras-dist launch -n 1", "jax", CALLBACKS),
    ("torch", "torchrun --nproc-per-node 1", "torch", CALLBACKS),
    ("tensorflow", "horovodrun -np 1", "horovod", CALLBACKS),
]


def expected_failures():
    """{node id under keras/src: why} from EXPECTED."""
    out = {}
    for line in EXPECTED.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            node, why = line.split(None, 1)
            out[node] = why
    return out


def deselected():
    """The `-k` expression leaving out grain's tests (not installed) and the expected failures
    (by class and name: pytest's `--deselect` needs node ids relative to its root directory,
    which differs from run to run)."""
    names = [" and ".join(node.split("::")[1:]) for node in expected_failures()]
    return " and ".join(["not grain", *[f"not ({name})" for name in names]])


def pytest_command(launcher, files):
    argv = [ROOT / "tests" / "keras_suites" / "run_pytest.py", "-p", "routing", "-p", "no:cacheprovider", "-q", "-rfE", "-o", "addopts=",
            *[str(KERAS_TESTS / f) for f in files], "-k", deselected()]
    if launcher == "plain":
        return [PYTHON, *argv]
    if launcher.startswith("keras-dist"):
        return [BIN / "keras-dist", "launch", "-n", 1, *argv]
    if launcher.startswith("torchrun"):
        return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 1, *argv]
    return horovodrun_command(1, argv)


@pytest.mark.parametrize("keras_backend, launcher, strategy, files", RUNS,
                         ids=[f"{b}-{launcher.split()[0]}" for b, launcher, _, _ in RUNS])
def test_keras_own_tests_pass_through_keras_dist(keras_backend, launcher, strategy, files, tmp_path):
    pytest.importorskip(keras_backend)
    if not (KERAS_TESTS / files[0]).exists():
        pytest.skip(f"Keras {keras.__version__} is installed without its test files (keras-nightly's wheel has none)")
    env = {"KERAS_BACKEND": keras_backend, "PYTHONPATH": str(ROOT / "tests" / "keras_suites")}
    if launcher != "plain":  # one process is not a cluster to detect: name the strategy, as a user may
        env["KERAS_DIST_BACKEND"] = strategy
    code, output = run(pytest_command(launcher, files), 840, env, cwd=tmp_path)
    listed = "\n".join(f"  {node}: {why}" for node, why in expected_failures().items()) or "  (none)"
    print(f"Keras's tests on {keras_backend} under {launcher}; listed as unable to pass:\n{listed}")
    summary = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)|keras_dist routing", line)]
    print("\n".join(summary))
    assert code == 0, output[-8000:]
    assert f"(strategy: {strategy})" in output, f"the tests did not run on {strategy}:\n" + "\n".join(summary)
    assert re.search(r"keras_dist routing: [1-9]\d* compiles", output), "\n".join(summary)
