"""Platforms that start the processes themselves (issue 54): the unchanged script, run as
each platform runs it, with no `keras-dist launch`, finds its place in the job from the
platform's own variables and trains as one process at the global batch.

On this machine: Open MPI's `mpirun` (installed with apt-get on first use) and the
variables Kubeflow Trainer's PyTorch runtime sets on each node; the hosts of a TPU slice
with GKE's variables are in tests/test_hosts.py.
"""

import json

import pytest

from hostbed import HostBedError, install_debian_package
from keras_dist.launchers.processes import free_ports
from runner import PYTHON, WORKERS, assert_trains_like, run, run_many

pytestmark = pytest.mark.timeout(600)
WORKER = WORKERS / "any_backend_worker.py"
GLOBAL_BATCH = 16


def reference(tmp_path, keras_backend):
    """One plain process at the global batch."""
    out = tmp_path / "reference"
    out.mkdir()
    code, output = run([PYTHON, WORKER, out, "--batch", GLOBAL_BATCH, "--adam"], 300,
                       env={"KERAS_BACKEND": keras_backend, "KERAS_DIST_BACKEND": "single"})
    assert code == 0, output[-3000:]
    return json.loads((out / "result-0.json").read_text())


def results(out, processes):
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(processes)]


@pytest.mark.parametrize("keras_backend", ["jax", "torch"])
def test_mpirun_starts_the_processes_and_they_train_as_one_at_the_global_batch(tmp_path, keras_backend):
    pytest.importorskip(keras_backend)
    try:
        install_debian_package("openmpi-bin", "/usr/bin/mpirun")
    except HostBedError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "mpirun"
    out.mkdir()
    # As root (this machine's tests run as root) Open MPI wants the flag; each process one core.
    code, output = run(["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", 2,
                        PYTHON, WORKER, out, "--batch", GLOBAL_BATCH // 2, "--adam"], 300,
                       env={"KERAS_BACKEND": keras_backend})
    assert code == 0, output[-4000:]
    assert "2 replicas in 2 processes on 1 machine (cluster environment: mpi)" in output, output[-3000:]
    expected = reference(tmp_path, keras_backend)
    for result in results(out, 2):
        assert_trains_like(result, expected)


def kubeflow_variables(rank, port):
    """What Kubeflow Trainer's PyTorch runtime sets on node `rank` of a 2-node TrainJob."""
    return {"KERAS_BACKEND": "torch", "PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(rank),
            "PET_MASTER_ADDR": "localhost", "PET_MASTER_PORT": str(port)}


def test_each_node_of_a_kubeflow_trainjob_running_the_script_itself_trains_as_one_at_the_global_batch(tmp_path):
    # The hosts of a TPU slice, started with GKE's variables: tests/test_hosts.py.
    pytest.importorskip("torch")
    (port,) = free_ports(1)
    out = tmp_path / "kubeflow"
    out.mkdir()
    outputs = run_many([[PYTHON, WORKER, out, "--batch", GLOBAL_BATCH // 2, "--adam"]] * 2, 300,
                       [kubeflow_variables(rank, port) for rank in range(2)])
    for code, output in outputs:
        assert code == 0, output[-4000:]
    # Kubeflow runs one process per node (pod), so each is a machine of its own.
    line = "2 replicas in 2 processes on 2 machines (cluster environment: kubeflow)"
    assert line in outputs[0][1], outputs[0][1][-3000:]
    expected = reference(tmp_path, "torch")
    for result in results(out, 2):
        assert_trains_like(result, expected)


@pytest.mark.parametrize("variables, named", [
    ({"TPU_WORKER_HOSTNAMES": "h0,h1", "TPU_WORKER_ID": "2"}, "TPU_WORKER_ID=2 is past the 2 hosts"),
    ({**kubeflow_variables(0, 29500), "PET_NPROC_PER_NODE": "4"}, "PET_NPROC_PER_NODE='4'"),
])
def test_contradicting_platform_variables_end_the_script_in_one_line_naming_the_variable(variables, named):
    code, output = run([PYTHON, "-c", "import keras_dist; keras_dist.init()"], 120,
                       env={"KERAS_BACKEND": "torch" if "PET_NNODES" in variables else "jax", **variables})
    lines = [line for line in output.splitlines() if "KerasDistError" in line]
    assert code != 0 and len(lines) == 1 and named in lines[0], output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_jax_process_started_alone_with_several_devices_trains_as_one_device_at_their_global_batch(tmp_path):
    # XLA's forced host devices stand in for a Cloud TPU VM's chips; no launcher, no variable.
    pytest.importorskip("jax")
    out = tmp_path / "alone"
    out.mkdir()
    code, output = run([PYTHON, WORKER, out, "--batch", GLOBAL_BATCH // 4, "--adam"], 300,
                       env={"KERAS_BACKEND": "jax", "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert code == 0 and "4 replicas in 1 process on 1 machine" in output, output[-3000:]
    assert_trains_like(results(out, 1)[0], reference(tmp_path, "jax"))


def test_torchrun_starting_jax_processes_trains_them_as_one_at_the_global_batch(tmp_path):
    # torchrun's agent holds MASTER_PORT (its store): JAX's coordinator takes a port of its own,
    # which rank 0 publishes in that store (before, rank 0 failed to start its RPC server).
    pytest.importorskip("jax")
    pytest.importorskip("torch")
    out = tmp_path / "torchrun"
    out.mkdir()
    code, output = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, WORKER, out,
                        "--batch", GLOBAL_BATCH // 2, "--adam"], 300, env={"KERAS_BACKEND": "jax"})
    assert code == 0, output[-4000:]
    assert "2 replicas in 2 processes on 1 machine (cluster environment: torchrun)" in output, output[-3000:]
    expected = reference(tmp_path, "jax")
    for result in results(out, 2):
        assert_trains_like(result, expected)
