"""Runs tests/workers/train_worker.py on the strategy backends and loads what it saved."""

import json
import os
import sys

from conftest import run_many  # tests/ is on sys.path under pytest
from keras_dist.launchers.processes import free_ports

WORKER = os.path.join(os.path.dirname(__file__), "train_worker.py")


def run(argv_list, envs, timeout=240):
    """Runs one Python process per (argv, env), together; returns their `(code, output)`s.

    Example:

    ```python
    outputs = run([[WORKER, out]], [{"KERAS_DIST_BACKEND": "single"}])
    ```
    """
    return run_many([[sys.executable, *argv] for argv in argv_list], timeout, envs)


def run_ok(argv_list, envs, timeout=240):
    outputs = run(argv_list, envs, timeout)
    for code, out in outputs:
        assert code == 0, out[-3000:]
    return outputs


def tf_config_envs(count):
    workers = [f"127.0.0.1:{p}" for p in free_ports(count)]
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


def assert_trains_like(result, reference, tolerance=1e-5):
    """`result` ended where `reference` did: weights, every logged metric, evaluate, predict.

    Example:

    ```python
    assert_trains_like(runner.train(tmp, "mirrored", "--cpus", 2, "--batch", 8)[0], single_at_16)
    ```
    """
    import numpy as np
    import pytest

    for key in ("weights", "predict"):
        for got, want in zip(result[key], reference[key]):
            np.testing.assert_allclose(np.array(got), np.array(want), atol=tolerance)
    assert result["history"].keys() == reference["history"].keys()
    for key, values in reference["history"].items():
        assert result["history"][key] == pytest.approx(values, rel=tolerance), key
    assert result["evaluate"] == pytest.approx(reference["evaluate"], rel=tolerance)


def load(out_dir, rank):
    with open(os.path.join(out_dir, f"result-{rank}.json")) as f:
        return json.load(f)
