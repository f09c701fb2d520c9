"""Faults at chosen moments, as a matrix per multi-process backend, with real processes.

Each backend's job meets one fault per run: a process killed or frozen mid-epoch, during
a save or during `evaluate`. The others must end within a bound (not train on, not hang),
checkpoints stay whole, and the next run resumes at the epoch the fault interrupted, so no
completed epoch is lost. The last run finishes; its weights equal an uninterrupted run's.
Horovod runs under `horovodrun`, MultiWorkerMirrored as separate processes that only
share `TF_CONFIG`, as on separate machines: no launcher stops the job for them. (The
parameter-server cases are in test_parameter_server.py: there, a lost worker is tolerated.)

Run with `-s` to see the matrix: case, backend, seconds to end, resumed epoch.
"""

import concurrent.futures
import json
import os
import subprocess
import time
import zipfile

import h5py
import numpy as np
import pytest

from runner import BIN, PYTHON, QUIET_ENV, WORKERS
from keras_dist.launchers.processes import kill_process_groups

import runner

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WORKER = WORKERS / "fault_matrix.py"

# (fault, moment, rank). Run i resumes at epoch i and meets its fault in epoch i + 1.
# (A kill mid-epoch: tests/test_resume.py, exact to the step; a freeze mid-epoch:
# tests/test_hosts.py, a frozen host.)
CHAIN = [
    ("kill", "save", 0),
    ("freeze", "evaluate", 0),
]
EPOCHS = len(CHAIN) + 2
# Seconds from the fault until every process that can still run has ended.
ENDS_WITHIN = {"kill": 30, "freeze": 60}


def start(backend, directory, *fault):
    """Starts the worker on 2 processes; returns their `Popen`s (one: horovodrun)."""
    temp = directory.parent / "tmp"
    temp.mkdir(exist_ok=True)
    base = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "TMPDIR": str(temp)}
    argv = [PYTHON, WORKER, directory, EPOCHS, *fault]
    if backend == "horovod":
        # A frozen rank is noticed when a collective waits the step timeout (Horovod's Gloo
        # timeout, default 30 s: the job then ends 41 s after the freeze, measured); shorter
        # here to keep the suite short.
        commands = [([BIN / "horovodrun", "-np", 2, "-H", "localhost:2", "--gloo", *argv],
                     {"KERAS_DIST_STEP_TIMEOUT": "10"})]
    else:  # the step timeout is TensorFlow's heartbeat timeout, default 30 s; 10 here too
        commands = [(argv, {**env, "KERAS_DIST_STEP_TIMEOUT": "10"}) for env in runner.tf_config_envs(2)]
    return [subprocess.Popen([str(a) for a in command], env={**base, **QUIET_ENV, **env}, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
            for command, env in commands]


def wait_for_the_end(procs, directory, fault, rank, timeout=300):
    """Waits until every process that can still run has exited; returns seconds since the fault."""
    frozen = procs[rank] if fault == "freeze" and len(procs) > 1 else None
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs if p is not frozen) and time.monotonic() < deadline:
            time.sleep(0.1)
        ended = time.time()
    finally:
        kill_process_groups(procs)  # the frozen process, as its operator would
    if time.monotonic() >= deadline:
        pytest.fail(f"{fault} of rank {rank}: the job did not end in {timeout}s (killed);\n{output(procs)[-4000:]}")
    record = directory / "fault.json"
    assert record.exists(), f"{fault} of rank {rank} was never injected;\n{output(procs)[-4000:]}"
    injected = json.loads(record.read_text())["time"]
    record.unlink()
    return ended - injected


def output(procs):
    return "".join(p.stdout.read() for p in procs if not p.stdout.closed)


def epochs_begun(directory, rank):
    path = directory / f"epochs.{rank}"
    epochs = [int(line) for line in path.read_text().split()]
    path.unlink()
    return epochs


def assert_checkpoints_whole(directory):
    with h5py.File(directory / "backup" / "latest.weights.h5", "r"):
        pass
    assert zipfile.ZipFile(directory / "model.keras").testzip() is None


def run_to_completion(backend, directory):
    procs = start(backend, directory)
    try:
        for proc in procs:
            proc.wait(timeout=300)
    finally:
        kill_process_groups(procs)
    out = output(procs)
    assert all(p.returncode == 0 for p in procs), out[-4000:]


def run_the_chain(backend, tmp_path):
    """Runs CHAIN on `backend` in `tmp_path`; returns the matrix rows `(case, seconds, resumed epoch)`."""
    uninterrupted = tmp_path / "uninterrupted"
    uninterrupted.mkdir()
    run_to_completion(backend, uninterrupted)

    directory = tmp_path / "faulted"
    directory.mkdir()
    rows = []
    for run, (fault, moment, rank) in enumerate(CHAIN):
        procs = start(backend, directory, fault, moment, rank, run + 1)
        seconds = wait_for_the_end(procs, directory, fault, rank)
        case = f"{fault} rank {rank} {moment.replace('_', '-')}"
        out = output(procs)
        assert all(p.returncode != 0 for p in procs), f"{backend} {case}: a process trained on alone;\n{out[-4000:]}"
        for r in range(2):
            # Others may begin the next epoch while the chief saves, then wait for it.
            assert epochs_begun(directory, r)[:2] == [run, run + 1], \
                f"{backend} {case}: rank {r} did not resume at epoch {run}"
        assert seconds < ENDS_WITHIN[fault], f"{backend} {case}: the job took {seconds:.1f}s to end;\n{out[-4000:]}"
        if fault == "freeze":  # a survivor names the frozen process in one line
            stopped = [line for line in out.splitlines() if "PeerFailure: " in line and "stopped answering" in line]
            assert stopped and f"rank {rank} on " in stopped[0], f"{backend} {case}:\n{out[-4000:]}"
            if backend == "horovod":  # KERAS_DIST_STEP_TIMEOUT became Horovod's Gloo timeout
                assert "stopped answering within 10 s" in stopped[0], stopped[0]
        assert_checkpoints_whole(directory)
        rows.append((case, seconds, run + 1))

    run_to_completion(backend, directory)
    # Killed MWMS workers leave their scratch copies of the model; the next run removes them.
    assert not list((tmp_path / "tmp").glob("keras_dist_scratch_*"))
    for r in range(2):
        assert epochs_begun(directory, r) == [len(CHAIN), len(CHAIN) + 1]
        with np.load(directory / f"weights.{r}.npz") as got, np.load(uninterrupted / f"weights.{r}.npz") as want:
            for key in want:
                np.testing.assert_allclose(got[key], want[key], atol=1e-6)
    return rows


def test_every_fault_ends_the_job_in_bounded_time_and_a_rerun_loses_no_completed_epoch(tmp_path):
    # The backends' chains run side by side: most of a chain is waiting for a fault to be
    # noticed (a Gloo or heartbeat timeout), time the other chain's processes compute in.
    backends = ["horovod", "multi_worker_mirrored"]
    for backend in backends:
        (tmp_path / backend).mkdir()
    with concurrent.futures.ThreadPoolExecutor(len(backends)) as pool:
        chains = {backend: pool.submit(run_the_chain, backend, tmp_path / backend) for backend in backends}
        rows = {backend: chain.result() for backend, chain in chains.items()}
    print()
    for backend in backends:
        for case, seconds, resumed in rows[backend]:
            print(f"| {case} | {backend} | {seconds:.1f} | {resumed} |")
