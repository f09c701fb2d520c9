"""Shared helpers: run real processes with a hard timeout and kill their whole group."""

import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

from keras_dist.launchers.processes import kill_process_groups

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
PYTHON = sys.executable
BIN = Path(PYTHON).parent

# Workers log nothing from TensorFlow's C++ side; keep failures readable.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "KERAS_DIST_BACKEND": ""}


def run_many(commands, timeout, envs=None, cwd=None):
    """Runs the commands together, each in its own process group; returns `(code, output)`s.

    On timeout (for all of them together) every group is killed and the test fails;
    groups are killed at the end in any case, for children that outlived their parent
    (horovodrun's workers, TensorFlow's helpers).
    """
    base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    procs = [
        subprocess.Popen(
            [str(a) for a in argv], env={**base, **QUIET_ENV, **env}, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        for argv, env in zip(commands, envs or [{}] * len(commands))
    ]
    deadline = time.monotonic() + timeout
    results = []
    try:
        for argv, proc in zip(commands, procs):
            try:
                out, _ = proc.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                kill_process_groups(procs)
                out, _ = proc.communicate()
                pytest.fail(f"{[str(a) for a in argv[:6]]} did not finish in {timeout}s (killed); output tail:\n{out[-4000:]}")
            results.append((proc.returncode, out))
    finally:
        kill_process_groups(procs)
    return results


def run(argv, timeout, env=None, cwd=None):
    """Runs one command with `run_many`'s guarantees; returns `(code, output)`."""
    return run_many([argv], timeout, [env or {}], cwd)[0]


def horovodrun(num_ranks, argv, timeout, env=None):
    command = [BIN / "horovodrun", "-np", num_ranks, "-H", f"localhost:{num_ranks}", "--gloo", PYTHON, *argv]
    return run(command, timeout, env)


def load_results(directory, name, ranks):
    results = []
    for rank in range(ranks):
        with open(Path(directory) / f"{name}.{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results
