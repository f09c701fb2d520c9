"""keras_dist on one GPU: the two-line change trains there, two ranks share it (PyTorch) or
are refused in one line (JAX), and mixed precision gives one process's result at 2B.

Each run is a real process (a real launcher for two ranks) under a hard timeout. The
canaries check that NCCL still refuses two processes on one GPU, the reason for gloo
(PyTorch) and for the refusal (JAX): when one fails, drop that workaround.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from keras_dist.environments import visible_gpus
from keras_dist.launchers.processes import free_ports

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from runner import PYTHON, run, run_many  # noqa: E402

ON_GPU = visible_gpus(os.environ) > 0
# KERAS_DIST_GPU_TESTS_ON_CPU=1 rehearses these tests on CPUs, with CPUs' expectations
# (tools/gpu_run.sh's dry run), so that device minutes go to the GPU.
pytestmark = pytest.mark.skipif(not ON_GPU and os.environ.get("KERAS_DIST_GPU_TESTS_ON_CPU") != "1",
                                reason="no NVIDIA GPU visible; tools/gpu_run.sh runs tests/gpu on a GPU machine")
WORKER = HERE / "gpu_worker.py"
LAUNCH = [PYTHON, "-m", "keras_dist.cli", "launch"]
POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# max |w - w_ref| / max |w_ref| after 32 steps. TF32 convolutions (cuDNN's and XLA's default
# on GPUs) and sums in another order put float32 near 1e-3; bfloat16 keeps 8 bits of mantissa.
TOLERANCE = {"float32": 5e-3, "mixed_float16": 2e-2, "mixed_bfloat16": 6e-2}


def train(tmp_path, name, backend, command, *flags, ranks=1, env=None):
    """Runs the worker under `command` (a launcher's, or none); `(output, each rank's results)`."""
    out = tmp_path / name
    out.mkdir()
    code, output = run([*command, WORKER, out, *flags], 300, env={"KERAS_BACKEND": backend, **(env or {})})
    assert code == 0, output[-4000:]
    loaded = []
    for rank in range(ranks):
        with np.load(out / f"result-{rank}.npz") as f:
            summary = json.loads(str(f["summary"]))
            for policy in POLICIES:
                count = sum(key.startswith(f"{policy}/") for key in f.files)
                summary[policy]["weights"] = [f[f"{policy}/{i}"] for i in range(count)]
        loaded.append(summary)
    return output, loaded


def relative_difference(weights, reference):
    return max(float(np.abs(w - r).max()) for w, r in zip(weights, reference)) / max(
        float(np.abs(r).max()) for r in reference)


def assert_equal_within_dtype(ours, reference):
    for policy in POLICIES:
        assert ours[policy]["loss"][-1] < ours[policy]["loss"][0], (policy, ours[policy]["loss"])
        difference = relative_difference(ours[policy]["weights"], reference[policy]["weights"])
        assert difference < TOLERANCE[policy], (policy, difference)


def assert_on_the_gpu(result):
    for policy in POLICIES:
        placed = (result[policy]["kernel_device"], result[policy]["step_device"])
        assert all(("cuda" in d.lower()) == ON_GPU for d in placed), placed


@pytest.mark.parametrize("backend", ["jax", "torch"])
def test_the_two_line_change_trains_on_the_gpu_as_plain_keras_does(tmp_path, backend):
    """One process under keras_dist's strategy for the backend (KERAS_DIST_BACKEND, as
    `keras_dist.init(backend=...)`), against plain Keras, in each precision policy."""
    _, (plain,) = train(tmp_path, "plain", backend, [PYTHON], "--batch", "32", "--plain")
    _, (ours,) = train(tmp_path, "keras_dist", backend, [PYTHON], "--batch", "32", env={"KERAS_DIST_BACKEND": backend})
    assert_on_the_gpu(ours)
    assert_equal_within_dtype(ours, plain)


def test_two_torch_ranks_on_one_gpu_equal_one_process_at_twice_the_batch(tmp_path):
    """`keras-dist launch -n 2` where the machine has fewer GPUs than ranks: both train on
    cuda:0, their gradients all-reduced over gloo (NCCL refuses), and at batch 16 each
    they end as one process at batch 32, in float32, mixed_bfloat16 and mixed_float16."""
    output, ranks = train(tmp_path, "two", "torch", [*LAUNCH, "--backend", "torch", "-n", 2], "--batch", "16", ranks=2)
    _, (one,) = train(tmp_path, "one", "torch", [PYTHON], "--batch", "32", env={"KERAS_DIST_BACKEND": "torch"})
    for rank in ranks:
        assert_on_the_gpu(rank)
        assert_equal_within_dtype(rank, one)
    for policy in POLICIES:
        assert ranks[0][policy]["loss"] == ranks[1][policy]["loss"]  # logs are global
    if ON_GPU:
        assert "over gloo through host memory" in output


def test_two_jax_processes_on_one_gpu_are_refused_in_one_line(tmp_path):
    """JAX gives each process GPUs of its own: two on one GPU end at once, with keras_dist's
    error line naming the fix."""
    if not ON_GPU:
        pytest.skip("on CPUs two JAX processes train (tests/test_keras_backends.py)")
    code, output = run([*LAUNCH, "--backend", "jax", "-n", 2, WORKER, tmp_path, "--batch", "16"], 120)
    assert code != 0
    errors = [line for line in output.splitlines() if "KerasDistError: 2 JAX processes share 1 GPU" in line]
    assert errors and "-n 1" in errors[0] and "JAX_PLATFORMS=cpu" in errors[0], output
    # Refused before JAX's GPU client starts: no NCCL error, no XLA check failure, no abort.
    assert not any(crash in output for crash in ("ncclInvalidUsage", "Check failed", "Fatal Python error")), output


PROBE = {
    # Two processes, both on GPU 0, sum one tensor over NCCL; prints SUMMED when NCCL accepts.
    "torch": """
import datetime, os, sys, torch, torch.distributed as dist
rank = int(sys.argv[1])
torch.cuda.set_device(0)
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=25))
t = torch.ones(4, device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
print("SUMMED", t.tolist(), flush=True)
""",
    "jax": """
import os, sys
os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.3"
import jax, jax.numpy as jnp, numpy as np
from jax.experimental import multihost_utils
rank = int(sys.argv[1])
jax.distributed.initialize("127.0.0.1:" + sys.argv[2], 2, rank, local_device_ids=[0], initialization_timeout=25)
total = multihost_utils.process_allgather(jnp.ones(4) * (rank + 1))
print("SUMMED", np.asarray(total).sum(axis=0).tolist(), flush=True)
""",
}


@pytest.mark.parametrize("engine", ["torch", "jax"])
def test_nccl_refuses_two_processes_on_one_gpu(tmp_path, engine):
    """Canary for the gloo fallback (PyTorch) and the one-line refusal (JAX): NCCL ends or
    stalls two processes that share a GPU. A timeout counts as refused: it ends them."""
    if not ON_GPU:
        pytest.skip("NCCL needs a GPU")
    script = tmp_path / "probe.py"
    script.write_text(PROBE[engine])
    port = str(free_ports(1)[0])
    try:
        outcomes = run_many([[PYTHON, script, rank, port] for rank in (0, 1)], 45)
    except pytest.fail.Exception:  # run_many fails the test on its timeout, after killing both
        return
    assert not all(code == 0 and "SUMMED" in output for code, output in outcomes), outcomes
    # Refused by NCCL or the GPU client, not by a broken probe.
    assert not any(error in output for _, output in outcomes
                   for error in ("SyntaxError", "NameError", "ModuleNotFoundError", "TypeError")), outcomes
