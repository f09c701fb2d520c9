"""Starts worker scripts in their own process groups, with a hard timeout, for the tests."""

import json
import os
import signal
import subprocess
import sys
import time

from keras_dist.launcher import free_loopback_ports

WORKER = os.path.join(os.path.dirname(__file__), "train_worker.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def run(argv_list, envs, timeout=240):
    """Runs one process per (argv, env) and returns their outputs; kills all on timeout.

    Args:
        argv_list: the command line of each process (without the interpreter).
        envs: extra environment variables of each process.
        timeout: seconds for all of them together.

    Example:

    ```python
    outputs = run([[WORKER, out]], [{"KERAS_DIST_BACKEND": "single"}])
    ```
    """
    procs = []
    base = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": ROOT}
    base.pop("TF_CONFIG", None)
    base.pop("KERAS_DIST_BACKEND", None)
    try:
        for argv, env in zip(argv_list, envs):
            procs.append(subprocess.Popen([sys.executable, *argv], env={**base, **env}, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, start_new_session=True, text=True))
        deadline = time.monotonic() + timeout
        outputs = []
        for proc in procs:
            try:
                out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"worker timed out after {timeout}s") from None
            outputs.append((proc.returncode, out))
        return outputs
    finally:
        for proc in procs:  # the whole group: TensorFlow may have started helpers
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            proc.wait()


def run_ok(argv_list, envs, timeout=240):
    outputs = run(argv_list, envs, timeout)
    for code, out in outputs:
        assert code == 0, out[-3000:]
    return outputs


def tf_config_envs(count):
    workers = [f"127.0.0.1:{p}" for p in free_loopback_ports(count)]
    return [{"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})}
            for i in range(count)]


def train(out_dir, backend, *args, timeout=240):
    """Runs train_worker.py on `backend` ("single", "mirrored" or "mwms") and loads results."""
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    argv = [WORKER, out_dir, *map(str, args)]
    if backend == "mwms":
        envs = tf_config_envs(2)
        run_ok([argv, argv], envs, timeout)
        return [load(out_dir, rank) for rank in range(2)]
    run_ok([argv], [{"KERAS_DIST_BACKEND": backend}], timeout)
    return [load(out_dir, 0)]


def load(out_dir, rank):
    with open(os.path.join(out_dir, f"result-{rank}.json")) as f:
        return json.load(f)
