"""The test helpers: run real processes with a hard timeout (killing their whole group), run
the training worker on a backend, and compare what trainings ended with."""

import concurrent.futures
import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from keras_dist.launchers.processes import free_ports, kill_process_groups

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
PYTHON = sys.executable
BIN = Path(PYTHON).parent

# Workers log nothing from TensorFlow's C++ side; keep failures readable.
QUIET_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONUNBUFFERED": "1", "KERAS_DIST_BACKEND": ""}
# The job's secret of the tests' `keras-dist launch --nnodes` (every machine's the same).
JOB_SECRET = "keras-dist-tests-job-secret"


def selected_backend(environ, requested=None):
    """The backend a process with the environment `environ` selects, read from that mapping only."""
    from keras_dist import environments, settings, strategies

    return strategies.select(requested, environ, settings.Settings.from_environ(environ), environments.detect(environ))[0]


def parent_pid(pid):
    """The pid of process `pid`'s parent (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


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
    # Each output is read on a thread of its own: a process whose pipe is full would
    # otherwise wait for the ones before it to end.
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        outputs = [pool.submit(proc.communicate, timeout=timeout) for proc in procs]
        results = []
        try:
            for argv, proc, output in zip(commands, procs, outputs):
                try:
                    out, _ = output.result()
                except subprocess.TimeoutExpired:
                    kill_process_groups(procs)
                    out, _ = proc.communicate()
                    pytest.fail(f"{[str(a) for a in argv[:6]]} did not finish in {timeout}s (killed); "
                                f"output tail:\n{out[-4000:]}")
                results.append((proc.returncode, out))
        finally:
            kill_process_groups(procs)
    return results


def run(argv, timeout, env=None, cwd=None):
    """Runs one command with `run_many`'s guarantees; returns `(code, output)`."""
    return run_many([argv], timeout, [env or {}], cwd)[0]


def horovodrun_command(num_ranks, argv):
    """`horovodrun` running the Python script `argv` on `num_ranks` local ranks over Gloo."""
    return [BIN / "horovodrun", "-np", num_ranks, "-H", f"localhost:{num_ranks}", "--gloo", PYTHON, *argv]


def horovodrun(num_ranks, argv, timeout, env=None):
    return run(horovodrun_command(num_ranks, argv), timeout, env)


def configuration_command(configuration, argv):
    """The command running the Python script `argv` under a pattern test's configuration:
    "plain_1" or "keras_dist_1" (one process), "launch_2" or "launch_3" (`keras-dist launch -n N`),
    "torchrun_2", "horovod_2", "mwms_2" (MultiWorkerMirrored) or "ps_2" (2 workers, 1 ps)."""
    if configuration.endswith("_1"):
        return [PYTHON, *argv]
    if configuration in ("launch_2", "launch_3"):
        return [BIN / "keras-dist", "launch", "-n", int(configuration[-1]), *argv]
    if configuration == "torchrun_2":
        return [PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, *argv]
    if configuration == "horovod_2":
        return horovodrun_command(2, argv)
    backend = {"mwms_2": "multi_worker_mirrored", "ps_2": "parameter_server"}[configuration]
    return [BIN / "keras-dist", "launch", "--backend", backend, "-n", 2,
            *(["--ps", 1] if backend == "parameter_server" else []), *argv]


def load_results(directory, name, ranks):
    results = []
    for rank in range(ranks):
        with open(Path(directory) / f"{name}.{rank}.pkl", "rb") as f:
            results.append(pickle.load(f))
    return results


WORKER = os.path.join(WORKERS, "train_worker.py")


def run_python(argv_list, envs, timeout=240):
    """Runs one Python process per (argv, env), together; returns their `(code, output)`s.

    Example:

    ```python
    outputs = run_python([[WORKER, out]], [{"KERAS_DIST_BACKEND": "single"}])
    ```
    """
    return run_many([[sys.executable, *argv] for argv in argv_list], timeout, envs)


def run_python_ok(argv_list, envs, timeout=240):
    outputs = run_python(argv_list, envs, timeout)
    for code, out in outputs:
        assert code == 0, out[-3000:]
    return outputs


def tf_config_envs(count):
    workers = [f"127.0.0.1:{p}" for p in free_ports(count)]
    return [{"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": i}})}
            for i in range(count)]


def train(out_dir, backend, *args, timeout=240, env=None):
    """Runs train_worker.py on `backend` ("single", "mirrored" or "mwms") and loads results;
    `env`: variables every process gets besides."""
    out_dir = str(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    argv = [WORKER, out_dir, *map(str, args)]
    if backend == "mwms":
        envs = [{**e, **(env or {})} for e in tf_config_envs(2)]
        run_python_ok([argv, argv], envs, timeout)
        return [load(out_dir, rank) for rank in range(2)]
    run_python_ok([argv], [{"KERAS_DIST_BACKEND": backend, **(env or {})}], timeout)
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

    for got, want in zip(result["weights"], reference["weights"]):
        np.testing.assert_allclose(np.array(got), np.array(want), atol=tolerance)
    np.testing.assert_allclose(np.array(result["predict"]), np.array(reference["predict"]), atol=tolerance)
    assert result["history"].keys() == reference["history"].keys()
    for key, values in reference["history"].items():
        assert result["history"][key] == pytest.approx(values, rel=tolerance), key
    assert result["evaluate"] == pytest.approx(reference["evaluate"], rel=tolerance)


def load(out_dir, rank):
    with open(os.path.join(out_dir, f"result-{rank}.json")) as f:
        return json.load(f)


def rotated(cases, in_ci, matrix_variable):
    """`cases` (values, or tuples of them, for a parametrize) of which a whole-suite run
    runs only `in_ci`, the others skipped unless the variable `matrix_variable` is "1":
    slow rows that share their code run one case each in CI, a different one per row."""
    assert in_ci in cases, (in_ci, cases)
    every = os.environ.get(matrix_variable) == "1"
    skip = pytest.mark.skip(reason=f"{matrix_variable}=1 runs it")
    return [pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=() if every or case == in_ci else skip)
            for case in cases]
