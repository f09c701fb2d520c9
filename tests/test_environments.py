"""Cluster environments read what each launcher sets, as the launcher sets it."""

import json

import pytest

from keras_dist import environments
from keras_dist.errors import KerasDistError

TF_CONFIG = {"cluster": {"chief": ["10.0.0.1:2222"], "worker": ["10.0.0.1:2223", "10.0.0.2:2222"],
                         "ps": ["10.0.0.3:2222"]}}


def tf_config(kind, index):
    return {"TF_CONFIG": json.dumps({**TF_CONFIG, "task": {"type": kind, "index": index}})}


@pytest.mark.parametrize("environ, expected", [
    ({}, ("local", 0, 1, 0, 1, None)),
    # horovodrun (Gloo) and mpirun
    ({"HOROVOD_RANK": "3", "HOROVOD_SIZE": "4", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"},
     ("mpi", 3, 4, 1, 2, None)),
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, ("mpi", 1, 8, 1, 4, None)),
    ({"PMI_RANK": "2", "PMI_SIZE": "3", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "1"}, ("mpi", 2, 3, 0, 1, None)),
    # ... given a rendezvous for torch.distributed or JAX, which they do not name themselves
    ({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
     ("mpi", 1, 2, 0, 1, "node1:29500")),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2", "KERAS_DISTRIBUTION_JOB_ADDRESSES": "node1:1234,node2:1234"},
     ("mpi", 0, 2, 0, 1, "node1:1234")),
    # TF_CONFIG: the chief, then the workers, train; a ps task is never the chief
    (tf_config("chief", 0), ("tf_config", 0, 3, 0, 2, "10.0.0.1:2222")),
    (tf_config("worker", 0), ("tf_config", 1, 3, 1, 2, "10.0.0.1:2222")),
    (tf_config("worker", 1), ("tf_config", 2, 3, 0, 1, "10.0.0.1:2222")),
    (tf_config("ps", 0), ("tf_config", 3, 3, 0, 1, "10.0.0.1:2222")),
    # torchrun
    ({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "node1",
      "MASTER_PORT": "29500"}, ("torchrun", 5, 8, 1, 4, "node1:29500")),
    # srun
    ({"SLURM_PROCID": "3", "SLURM_STEP_NUM_TASKS": "4", "SLURM_LOCALID": "1", "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
      "SLURM_STEP_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "123456"}, ("slurm", 3, 4, 1, 2, "gpu07:13456")),
    ({"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "node5",
      "KERAS_DIST_COORDINATOR_PORT": "4000"}, ("slurm", 0, 1, 0, 1, "node5:4000")),
    # keras.distribution.initialize's variables (JAX's coordinator)
    ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234,10.0.0.2:1234", "KERAS_DISTRIBUTION_NUM_PROCESSES": "2",
      "KERAS_DISTRIBUTION_PROCESS_ID": "1"}, ("keras_distribution", 1, 2, 0, 1, "10.0.0.1:1234")),
    # ... with the place on its machine that `keras-dist launch` adds (which GPUs a process takes)
    ({"KERAS_DISTRIBUTION_JOB_ADDRESSES": "10.0.0.1:1234", "KERAS_DISTRIBUTION_NUM_PROCESSES": "4",
      "KERAS_DISTRIBUTION_PROCESS_ID": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
     ("keras_distribution", 3, 4, 1, 2, "10.0.0.1:1234")),
], ids=["none", "horovodrun", "openmpi", "mpich", "mpirun-master-addr", "horovodrun-keras-addresses", "tf-chief", "tf-worker0", "tf-worker1", "tf-ps", "torchrun",
        "srun", "srun-port", "keras-distribution", "keras-distribution-local"])
def test_each_launcher_is_detected_and_read(environ, expected):
    env = environments.detect(environ)
    assert (env.name, env.rank, env.size, env.local_rank, env.local_size, env.coordinator) == expected
    assert env.is_chief == (expected[1] == 0)


def test_a_slurm_batch_script_without_srun_is_one_process():
    assert environments.detect({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}).name == "local"


def test_horovodrun_inside_srun_is_read_from_horovod():
    environ = {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "SLURM_STEP_NODELIST": "n1",
               "HOROVOD_RANK": "1", "HOROVOD_SIZE": "2"}
    assert (environments.detect(environ).name, environments.detect(environ).rank) == ("mpi", 1)


@pytest.mark.parametrize("nodelist, host", [("node[03-05,9],gpu1", "node03"), ("gpu1,gpu2", "gpu1"), ("a", "a"),
                                            ("rack1-n[1,3]", "rack1-n1")])
def test_first_host_of_a_slurm_node_list(nodelist, host):
    assert environments.first_host(nodelist) == host


@pytest.mark.parametrize("environ, fix", [
    ({"HOROVOD_RANK": "one"}, "HOROVOD_RANK='one' is not an integer"),
    ({"RANK": "-1", "WORLD_SIZE": "2", "MASTER_ADDR": "a", "MASTER_PORT": "1"}, "rank -1 of 2 processes"),
    ({"TF_CONFIG": "{"}, "TF_CONFIG is not valid JSON"),
])
def test_bad_launcher_variables_are_a_one_line_error(environ, fix):
    with pytest.raises(KerasDistError, match=fix) as error:
        environments.detect(environ)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("listed, count", [("0,1", 2), ("", 0), ("-1", 0), ("0,-1,2", 1), ("GPU-77c0215f", 1)])
def test_visible_gpus_count_as_cuda_reads_its_list(listed, count):
    """CUDA_VISIBLE_DEVICES as CUDA reads it: up to the first invalid entry; "" and -1 hide all."""
    assert environments.visible_gpus({"CUDA_VISIBLE_DEVICES": listed}) == count


def test_the_local_launcher_tells_jax_processes_their_place_on_the_machine():
    from keras_dist.launchers.keras_distribution import KerasDistributionLauncher

    tasks = KerasDistributionLauncher().tasks(3, 0, ["train.py"], None)
    places = [environments.detect(task.env) for task in tasks]
    assert [(p.rank, p.size, p.local_rank, p.local_size) for p in places] == [(i, 3, i, 3) for i in range(3)]


def test_jax_counts_a_hosts_devices_without_starting():
    # The selection itself, with a real JAX process: tests/test_examples.py (several devices).
    forced = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    assert environments.jax_local_devices(forced) == 4
    assert environments.jax_local_devices({**forced, "JAX_PLATFORMS": "cpu"}) == 4
    assert environments.jax_local_devices({**forced, "JAX_PLATFORMS": "cuda"}) == 1
    assert environments.jax_local_devices({"JAX_PLATFORMS": "cpu"}) == 1
