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


def test_the_hosts_of_a_tpu_slice_and_of_several_slices_are_read_from_gkes_variables():
    slice_hosts = {"TPU_WORKER_HOSTNAMES": "t-0.svc,t-1.svc", "TPU_WORKER_ID": "1"}
    place = environments.detect(slice_hosts)
    assert (place.name, place.rank, place.size, place.local_size, place.coordinator) == \
        ("tpu_slice", 1, 2, 1, "t-0.svc:8482")
    # Multislice: slice 1's second host is rank 3 of 4; the coordinator is the one named.
    place = environments.detect({**slice_hosts, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1",
                                 "MEGASCALE_COORDINATOR_ADDRESS": "s0-0.svc:8080", "KERAS_DIST_COORDINATOR_PORT": "9"})
    assert (place.rank, place.size, place.coordinator) == (3, 4, "s0-0.svc:9")
    assert environments.detect({"TPU_WORKER_ID": "0"}).name == "local"  # a single-host TPU VM: no slice


def test_kubeflow_trainjobs_variables_name_the_node_and_the_master():
    place = environments.detect({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_NPROC_PER_NODE": "1",
                                 "PET_MASTER_ADDR": "job-node-0-0.job", "PET_MASTER_PORT": "29400"})
    assert (place.name, place.rank, place.size, place.coordinator) == ("kubeflow", 2, 3, "job-node-0-0.job:29400")
    # Under torchrun (which reads PET_*), torchrun's own variables say more.
    assert environments.detect({"PET_NNODES": "3", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1",
                                "RANK": "5", "WORLD_SIZE": "6", "MASTER_ADDR": "m", "MASTER_PORT": "1"}).name == "torchrun"


def test_open_mpis_mpirun_machine_is_the_coordinator_for_jax_and_torch():
    launched = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2",
                "OMPI_MCA_orte_hnp_uri": "104464384.0;tcp://192.0.2.2,10.0.0.7:37677;tcp6://[fd00::2]:41975"}
    place = environments.detect(launched)
    # The same in every process of one mpirun; the port from its job family (104464384 >> 16 = 1594).
    assert (place.name, place.rank, place.coordinator) == ("mpi", 1, "192.0.2.2:11594")
    assert environments.detect({**launched, "MASTER_ADDR": "n0", "MASTER_PORT": "5"}).coordinator == "n0:5"
    assert environments.detect({**launched, "KERAS_DIST_COORDINATOR_PORT": "7"}).coordinator == "192.0.2.2:7"
    # MPICH names no machine: MASTER_ADDR does, else the strategy's one line asks for it.
    assert environments.detect({"PMI_RANK": "0", "PMI_SIZE": "2"}).rendezvous() is None


@pytest.mark.parametrize("environ, fix", [
    ({"TPU_WORKER_HOSTNAMES": "a,b", "TPU_WORKER_ID": "2"}, "TPU_WORKER_ID=2 is past the 2 hosts"),
    ({"TPU_WORKER_HOSTNAMES": "a", "TPU_WORKER_ID": "0", "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "2"},
     "MEGASCALE_SLICE_ID=2 is past MEGASCALE_NUM_SLICES=2"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1"},
     "PET_NODE_RANK=2 is not one of the PET_NNODES=2 nodes"),
    ({"PET_NNODES": "2", "PET_NODE_RANK": "0", "PET_MASTER_ADDR": "m", "PET_MASTER_PORT": "1",
      "PET_NPROC_PER_NODE": "auto"}, "PET_NPROC_PER_NODE='auto'"),
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
