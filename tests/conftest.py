"""Shared helpers: run real processes with a hard timeout and kill their whole group."""

import os
import pickle
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
PYTHON = sys.executable
BIN = Path(PYTHON).parent

# Workers log nothing from TensorFlow's C++ side; keep failures readable.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "KERAS_DIST_BACKEND": ""}


def run(argv, timeout, env=None, cwd=None):
    """Runs `argv` in its own process group; on timeout kills the group and fails."""
    proc = subprocess.Popen(
        [str(a) for a in argv], env={**os.environ, **QUIET_ENV, **(env or {})}, cwd=cwd,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{argv[:6]} did not finish in {timeout}s (killed); output tail:\n{out[-4000:]}")
    finally:
        try:  # children that outlived their parent (horovodrun workers)
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, out


def horovodrun(num_ranks, argv, timeout, env=None):
    command = [BIN / "horovodrun", "-np", num_ranks, "-H", f"localhost:{num_ranks}", "--gloo", PYTHON, *argv]
    return run(command, timeout, env)


def load_results(directory, name, ranks):
    results = []
    for rank in range(ranks):
        with open(Path(directory) / f"{name}.{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
