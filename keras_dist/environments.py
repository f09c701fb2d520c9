"""Cluster environments: who this process is in its job, read from what its launcher set.

One class per launcher. `detect(environ)` says whether the launcher started this process;
`from_environ(environ)` reads its place: rank and size among the processes that train,
local rank and size on this machine, and the coordinator's `host:port` where the launcher
names one (the rendezvous JAX's and torch's process groups need). Nothing here starts or
imports a framework, so reading the environment is cheap and safe for tools.

Example:

```python
env = detect(os.environ)   # the first environment whose launcher is present
print(env.name, env.rank, env.size, env.is_chief, env.coordinator)
```
"""

import glob
import json
import os
import pkgutil
import re
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from keras_dist.errors import KerasDistError

_EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'

# How long a process waits for the chief to publish the rendezvous address.
RENDEZVOUS_TIMEOUT_SECONDS = 120


@dataclass(frozen=True)
class ClusterEnvironment:
    """This process's place in its job.

    Args:
        rank: index among the `size` processes that train (0 is the chief).
        size: how many processes train.
        local_rank: index among those on this machine.
        local_size: how many of them run on this machine.
        coordinator: `host:port` of the job's rendezvous, where the launcher gives one.
        job_address: the address of this machine's interface that the job's traffic takes
            (`keras_dist.network`), set at start-up in a job of several processes; None
            where nothing is known.
    """

    name: ClassVar[str] = ""
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    coordinator: str | None = None
    job_address: str | None = None

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    # Variables that, all present, show this environment's launcher started the process.
    REQUIRED: ClassVar[tuple] = ()
    # Whether the launcher says how many processes share this machine (`local_size`).
    KNOWS_LOCAL_SIZE: ClassVar[bool] = True

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        """Whether this environment's launcher started the process."""
        return all(name in environ for name in cls.REQUIRED)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "ClusterEnvironment":
        """The process's place, read from `environ`; a one-line error names a bad value."""
        raise NotImplementedError

    def rendezvous(self) -> str | None:
        """`host:port` where the job's process group (JAX's, torch.distributed's) meets.

        The launcher's `coordinator` by default. Called only by a strategy that starts a
        process group, so reading an environment stays free of network traffic.
        """
        return self.coordinator

    def server_rendezvous(self) -> str | None:
        """`host:port` where a process group whose server rank 0 starts itself meets (JAX's
        coordinator); `rendezvous` unless the launcher's own server holds that port."""
        return self.rendezvous()

    @property
    def threads_per_process(self) -> int:
        """This machine's cores shared among its `local_size` processes: each sizes its thread
        pools for all of them otherwise."""
        return threads_per_process(self.local_size)

    def describe(self) -> dict:
        return {"cluster_environment": self.name, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "local_size": self.local_size, "coordinator": self.coordinator,
                "job_address": self.job_address}


def threads_per_process(local_size: int) -> int:
    """The cores of this machine divided among `local_size` processes (at least one each)."""
    return max(1, (os.cpu_count() or 1) // local_size)


def visible_gpus(environ: Mapping[str, str]) -> int:
    """The NVIDIA GPUs a process started with `environ` may use on this machine, counted
    without starting CUDA (a framework that did could not be forked or configured after)."""
    listed = environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        # CUDA stops at the first invalid entry; "" and "-1" hide every GPU.
        entries = [e.strip() for e in listed.split(",")]
        count = 0
        for entry in entries:
            if not entry or entry.startswith("-"):
                break
            count += 1
        return count
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))  # one folder per GPU the driver found
    except OSError:  # a container may show the device files without the driver's /proc entries
        return len(glob.glob("/dev/nvidia[0-9]*"))


def jax_local_devices(environ: Mapping[str, str]) -> int:
    """The devices JAX will give a process started with `environ`, counted without starting
    JAX (its process group must start first, where there is one): the host devices
    `XLA_FLAGS` forces (a CPU stand-in for accelerators), a Cloud TPU VM's chips
    (`/dev/accel*`, `/dev/vfio/N`), or the visible GPUs where JAX's CUDA plugin is
    installed; else 1 (a CPU process)."""
    platforms = environ.get("JAX_PLATFORMS", "")
    forced = re.search(r"--xla_force_host_platform_device_count=(\d+)", environ.get("XLA_FLAGS", ""))
    if platforms == "cpu" or forced:
        return int(forced.group(1)) if forced and platforms in ("", "cpu") else 1
    chips = len(glob.glob("/dev/accel[0-9]*")) or len(glob.glob("/dev/vfio/[0-9]*"))
    if chips and platforms in ("", "tpu"):
        return chips
    if platforms in ("", "cuda", "gpu") and jax_cuda_plugin_installed():
        return max(1, visible_gpus(environ))
    return 1


def jax_cuda_plugin_installed() -> bool:
    """Whether JAX's CUDA support (a plugin package: jax-cuda12-plugin, ...) is installed, without importing JAX."""
    try:
        import jax_plugins
    except ImportError:
        return False
    return any("cuda" in plugin.name for plugin in pkgutil.iter_modules(jax_plugins.__path__))


def _first(environ, names, default=None):
    """The integer value of the first of `names` set in `environ`."""
    for name in names:
        if name in environ:
            try:
                return int(environ[name])
            except ValueError:
                raise KerasDistError(f"{name}={environ[name]!r} is not an integer; unset it or fix the launcher") from None
    return default


@dataclass(frozen=True)
class MPIEnvironment(ClusterEnvironment):
    """`horovodrun` (Gloo or MPI) and `mpirun` (Open MPI, MPICH/Intel MPI through PMI).

    They name no rendezvous for torch.distributed or JAX. `MASTER_ADDR`/`MASTER_PORT`,
    or `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the first), set in the job's environment,
    give one; otherwise, under `horovodrun --gloo` (and `keras-dist launch --backend
    horovod`), the chief picks a free port on its host and publishes it in Horovod's
    own rendezvous store (`store`, `host:port`), where the others read it, and under
    Open MPI's `mpirun` the coordinator is on `mpirun`'s machine (`_open_mpi_launcher`).
    """

    store: str | None = None
    hostname: str | None = None
    # Started by horovodrun (or `keras-dist launch --backend horovod`): Horovod's own
    # collectives can join, whatever the Keras backend.
    horovodrun: bool = False

    name = "mpi"
    RANK = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
    SIZE = ("HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
    LOCAL_RANK = ("HOROVOD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")
    LOCAL_SIZE = ("HOROVOD_LOCAL_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return any(name in environ for name in cls.RANK)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "MPIEnvironment":
        rank = _first(environ, cls.RANK, 0)
        store = None
        if environ.get("HOROVOD_GLOO_RENDEZVOUS_ADDR") and environ.get("HOROVOD_GLOO_RENDEZVOUS_PORT"):
            store = f"{environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
        return cls(rank=rank, size=_first(environ, cls.SIZE, rank + 1),
                   local_rank=_first(environ, cls.LOCAL_RANK, 0), local_size=_first(environ, cls.LOCAL_SIZE, 1),
                   coordinator=_rendezvous(environ) or (None if store else _open_mpi_launcher(environ)),
                   store=store, hostname=environ.get("HOROVOD_HOSTNAME"), horovodrun="HOROVOD_RANK" in environ)

    def put(self, key: str, value: str, timeout: float = 30) -> None:
        """Stores `value` under `key` (no "/": the store's paths are scope/key) in Horovod's rendezvous store."""
        request = urllib.request.Request(f"http://{self.store}/keras_dist/{key}", data=value.encode(), method="PUT")
        urllib.request.urlopen(request, timeout=timeout)

    def get(self, key: str, timeout: float = 30) -> str | None:
        """The value under `key` in Horovod's rendezvous store; None while there is none."""
        try:
            return urllib.request.urlopen(f"http://{self.store}/keras_dist/{key}", timeout=timeout).read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code != 404:
                raise
            return None

    def rendezvous(self) -> str | None:
        if self.coordinator or not self.store or self.size == 1:
            return self.coordinator
        if self.is_chief:
            host = self.hostname or socket.gethostname()
            with socket.socket() as probe:
                probe.bind(("127.0.0.1" if host in ("localhost", "127.0.0.1") else "", 0))
                address = f"{host}:{probe.getsockname()[1]}"
            self.put("coordinator", address)
            return address
        deadline = time.monotonic() + RENDEZVOUS_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            address = self.get("coordinator")  # none until the chief has published it
            if address is not None:
                return address
            time.sleep(0.1)
        raise KerasDistError(f"rank 0 published no rendezvous address in Horovod's store ({self.store}) within "
                             f"{RENDEZVOUS_TIMEOUT_SECONDS} s; check that rank 0 started, or set MASTER_ADDR and MASTER_PORT")


def _rendezvous(environ):
    """`host:port` from torchrun's or `keras.distribution`'s variables, where either is set."""
    if environ.get("MASTER_ADDR") and environ.get("MASTER_PORT"):
        return f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}"
    addresses = [a for a in environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "").split(",") if a]
    return addresses[0] if addresses else None


def _open_mpi_launcher(environ):
    """Under Open MPI's `mpirun` (4.x, ORTE): `host:port` on the machine `mpirun` runs on.

    Its URI (`OMPI_MCA_orte_hnp_uri`, "JOBID.0;tcp://ADDRESS[,ADDRESS...]:PORT") is the same
    in every process, so each derives the same coordinator with no exchange: rank 0 runs
    there when that machine comes first in the host list, as `mpirun` places ranks by
    default (`MASTER_ADDR` names another). The port comes from the job id, distinct per
    `mpirun`, or `KERAS_DIST_COORDINATOR_PORT`.
    """
    uri = environ.get("OMPI_MCA_orte_hnp_uri")
    match = re.match(r"(\d+)[.;].*?tcp://([^,:;]+)", uri or "")
    if not match:
        return None
    # Open MPI's job ids keep the mpirun's random job family in their upper 16 bits.
    port = _first(environ, ["KERAS_DIST_COORDINATOR_PORT"]) or 10000 + (int(match.group(1)) >> 16) % 20000
    return f"{match.group(2)}:{port}"


def detected_cluster(environ: Mapping[str, str]) -> dict | None:
    """TF_CONFIG's cluster, read leniently for backend detection.

    Args:
        environ: the environment to read.

    Returns:
        None without TF_CONFIG; `{}` when it cannot be read (the backend chosen then
        parses it with `parse_tf_config`, which says what is wrong); else the cluster dict.

    Example:

    ```python
    has_ps = bool((detected_cluster(environ) or {}).get("ps"))
    ```
    """
    text = environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        cluster = json.loads(text).get("cluster")
    except (ValueError, AttributeError):
        return {}
    return cluster if isinstance(cluster, dict) else {}


def parse_tf_config(text: str) -> tuple[dict[str, list[str]], str, int]:
    """`(cluster, task_type, task_index)` from a TF_CONFIG string, with one-line errors.

    Args:
        text: the value of the TF_CONFIG environment variable.

    Example:

    ```python
    cluster, kind, index = parse_tf_config(environ["TF_CONFIG"])
    ```
    """
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise KerasDistError(f"TF_CONFIG is not valid JSON ({exc}); set it like {_EXAMPLE}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise KerasDistError(f'TF_CONFIG has no "cluster" object; set it like {_EXAMPLE}')
    cluster = config["cluster"]
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise KerasDistError('TF_CONFIG has no "task"; add "task": {"type": "worker", "index": N} for this process')
    kind, index = task["type"], task.get("index", 0)
    if kind not in cluster:
        raise KerasDistError(f"TF_CONFIG task type {kind!r} is not in its cluster ({', '.join(cluster)}); use one of those")
    if not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
        raise KerasDistError(
            f"TF_CONFIG task index {index!r} is out of range: the cluster has {len(cluster[kind])} "
            f"{kind!r} tasks; use an index from 0 to {len(cluster[kind]) - 1}"
        )
    addresses = [a for tasks in cluster.values() for a in tasks]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise KerasDistError(f"TF_CONFIG lists {duplicates[0]} more than once; give every task its own host:port")
    return cluster, kind, index



@dataclass(frozen=True)
class TFConfigEnvironment(ClusterEnvironment):
    """`TF_CONFIG` (tf.distribute's multi-worker and parameter-server jobs, `keras-dist launch`).

    The processes that train are the `chief` task, if any, then the `worker` tasks; a
    `ps` or `evaluator` task gets its index within its own kind and is never the chief.
    Processes are on the same machine when their addresses name the same host.

    Args:
        cluster: TF_CONFIG's cluster, `{task type: [host:port, ...]}`.
        task_type: this process's task type ("chief", "worker", "ps", ...).
        task_index: its index among the tasks of its type.
    """

    name = "tf_config"
    cluster: dict = field(default_factory=dict, compare=False)
    task_type: str = "worker"
    task_index: int = 0
    TRAINERS = ("chief", "worker")

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return bool(environ.get("TF_CONFIG"))

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "TFConfigEnvironment":
        cluster, kind, index = parse_tf_config(environ.get("TF_CONFIG", ""))
        trainers = [address for k in cls.TRAINERS for address in cluster.get(k, [])]
        me = cluster[kind][index]
        members = trainers if kind in cls.TRAINERS else cluster[kind]
        rank = members.index(me)
        host = me.rsplit(":", 1)[0]
        same_host = [address for address in members if address.rsplit(":", 1)[0] == host]
        if kind not in cls.TRAINERS:
            # Not a trainer: a rank past the trainers', so that it is never the chief.
            rank += len(trainers)
        return cls(rank=rank, size=len(trainers), local_rank=same_host.index(me), local_size=len(same_host),
                   coordinator=trainers[0] if trainers else None, cluster=cluster, task_type=kind, task_index=index)


def _ray_train_context():
    """The Ray Train context of this process, where it is a Ray Train worker (its training
    function runs here); else None. Never imports Ray: a Ray Train worker has imported
    `ray.train` before it runs the training function."""
    train = sys.modules.get("ray.train")
    if train is None:
        return None
    try:
        return train.get_context()
    except Exception:  # outside a training function: Ray raises (RuntimeError, or its own)
        return None


class RayTrainEnvironment(ClusterEnvironment):
    """A Ray Train worker (any trainer: `TorchTrainer`, `JaxTrainer`, `DataParallelTrainer`):
    rank, size and the place on its node from Ray Train's context, which every trainer sets,
    where only some set variables (`TorchTrainer` torchrun's, on CPUs `JaxTrainer` none).
    Ray names no rendezvous for keras_dist's own process group (the torch one a
    `TorchTrainer` started is used as it is): rank 0 picks a free port on its node and
    sends it to the others through Ray Train (`rendezvous`); its port is not `MASTER_PORT`,
    where rank 0 of a `TorchTrainer` already serves torch's store."""

    name = "ray_train"

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return "RAY_RAYLET_PID" in environ and _ray_train_context() is not None  # a Ray worker process

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "RayTrainEnvironment":
        context = _ray_train_context()
        return cls(rank=context.get_world_rank(), size=context.get_world_size(), local_rank=context.get_local_rank(),
                   local_size=context.get_local_world_size())

    def rendezvous(self) -> str | None:
        if self.size == 1:
            return None
        try:
            from ray.train.collective import broadcast_from_rank_zero
        except ImportError:  # Ray Train v1 (RAY_TRAIN_V2_ENABLED=0) has no collectives
            raise KerasDistError("under Ray Train v1 keras_dist cannot agree on a coordinator; run Ray Train v2 "
                                 "(RAY_TRAIN_V2_ENABLED=1, the default), or use TorchTrainer on PyTorch") from None
        address = None
        if self.is_chief:
            import ray.util

            host = ray.util.get_node_ip_address()
            with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
                probe.bind((host, 0))
                port = probe.getsockname()[1]
            address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        return broadcast_from_rank_zero(address)


@dataclass(frozen=True)
class TorchrunEnvironment(ClusterEnvironment):
    """`torchrun` / `torch.distributed.launch`, and launchers that mimic them."""

    # Under torchrun itself, its agent's store serves MASTER_PORT (torch's process group joins
    # it as a client); the attempt numbers what the store keeps across restarts.
    agent_store: bool = False
    attempt: int = 0

    name = "torchrun"
    REQUIRED = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "TorchrunEnvironment":
        return cls(rank=_first(environ, ["RANK"]), size=_first(environ, ["WORLD_SIZE"]),
                   local_rank=_first(environ, ["LOCAL_RANK"], 0), local_size=_first(environ, ["LOCAL_WORLD_SIZE"], 1),
                   coordinator=f"{environ['MASTER_ADDR']}:{environ['MASTER_PORT']}",
                   agent_store=environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
                   attempt=_first(environ, ["TORCHELASTIC_RESTART_COUNT"], 0))

    def server_rendezvous(self) -> str | None:
        if not self.agent_store or self.size == 1:
            return self.rendezvous()
        # Rank 0 picks a free port on the address it reaches the agent's store from, and
        # publishes it there (torch is installed wherever torchrun runs).
        import datetime

        from torch.distributed import TCPStore

        host, port = self.coordinator.rsplit(":", 1)
        store = TCPStore(host.strip("[]"), int(port), is_master=False,
                         timeout=datetime.timedelta(seconds=RENDEZVOUS_TIMEOUT_SECONDS))
        key = f"keras_dist/coordinator/{self.attempt}"
        if not self.is_chief:
            return store.get(key).decode()
        with socket.create_connection((host.strip("[]"), int(port)), timeout=RENDEZVOUS_TIMEOUT_SECONDS) as probe:
            own = probe.getsockname()[0]
        with socket.socket(socket.AF_INET6 if ":" in own else socket.AF_INET) as free:
            free.bind((own, 0))
            address = f"[{own}]:{free.getsockname()[1]}" if ":" in own else f"{own}:{free.getsockname()[1]}"
        store.set(key, address)
        return address


class SlurmEnvironment(ClusterEnvironment):
    """`srun`: one task per process. The coordinator is the step's first node, on port
    `KERAS_DIST_COORDINATOR_PORT`, else one derived from the job id (distinct per job)."""

    name = "slurm"
    REQUIRED = ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID")  # an `srun` step's tasks, not the batch script

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "SlurmEnvironment":
        port = _first(environ, ["KERAS_DIST_COORDINATOR_PORT"]) or 10000 + _first(environ, ["SLURM_JOB_ID"], 0) % 20000
        nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
        return cls(rank=_first(environ, ["SLURM_PROCID"]), size=_first(environ, ["SLURM_STEP_NUM_TASKS"]),
                   local_rank=_first(environ, ["SLURM_LOCALID"], 0),
                   local_size=_tasks_on_first_node(environ.get("SLURM_STEP_TASKS_PER_NODE", "1")),
                   coordinator=f"{first_host(nodes)}:{port}" if nodes else None)


def first_host(nodelist: str) -> str:
    """The first host of a Slurm node list: `node[03-05,9],gpu1` -> `node03`."""
    match = re.match(r"([^,\[]+)(?:\[([^\],-]+))?", nodelist)
    if not match:
        raise KerasDistError(f"cannot read the Slurm node list {nodelist!r}; set RANK, WORLD_SIZE, MASTER_ADDR "
                             "and MASTER_PORT as torchrun does instead")
    return match.group(1) + (match.group(2) or "")


def _tasks_on_first_node(tasks_per_node):
    """Slurm's `2(x3),1` -> 2 (this module assumes the same count on every node)."""
    match = re.match(r"(\d+)", tasks_per_node)
    return int(match.group(1)) if match else 1


class TPUSliceEnvironment(ClusterEnvironment):
    """The hosts of a Cloud TPU slice as GKE (and a queued-resource TPU VM) names them: one
    process per host, `TPU_WORKER_ID` among the hosts of `TPU_WORKER_HOSTNAMES` (or
    `TPU_PROCESS_ADDRESSES`), and for several slices (Multislice) `MEGASCALE_NUM_SLICES`,
    `MEGASCALE_SLICE_ID` and `MEGASCALE_COORDINATOR_ADDRESS`. The coordinator is the first
    host (of slice 0) on port `TPU_COORDINATOR_PORT`, or `KERAS_DIST_COORDINATOR_PORT`."""

    name = "tpu_slice"
    REQUIRED = ("TPU_WORKER_ID",)
    HOSTS = ("TPU_PROCESS_ADDRESSES", "TPU_WORKER_HOSTNAMES")
    # JAX's own coordinator port on TPU hosts, so that rules written for JAX fit.
    TPU_COORDINATOR_PORT = 8482

    @classmethod
    def detect(cls, environ: Mapping[str, str]) -> bool:
        return super().detect(environ) and any(environ.get(name) for name in cls.HOSTS)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "TPUSliceEnvironment":
        variable = next(name for name in cls.HOSTS if environ.get(name))
        hosts = [h.strip() for h in environ[variable].split(",") if h.strip()]
        worker, slices, slice_id = (_first(environ, [name], default) for name, default in
                                    (("TPU_WORKER_ID", 0), ("MEGASCALE_NUM_SLICES", 1), ("MEGASCALE_SLICE_ID", 0)))
        if not 0 <= worker < len(hosts):
            raise KerasDistError(f"TPU_WORKER_ID={worker} is past the {len(hosts)} hosts of {variable}; "
                                 "fix the slice's variables (each host's index in that list)")
        if not 0 <= slice_id < slices:
            raise KerasDistError(f"MEGASCALE_SLICE_ID={slice_id} is past MEGASCALE_NUM_SLICES={slices}; "
                                 "fix the Multislice variables")
        first = environ.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]
        port = _first(environ, ["KERAS_DIST_COORDINATOR_PORT"]) or cls.TPU_COORDINATOR_PORT
        return cls(rank=slice_id * len(hosts) + worker, size=slices * len(hosts),
                   coordinator=f"{_without_port(first)}:{port}")


def _without_port(address: str) -> str:
    """`host` of `host`, `host:port` or `[v6]:port`."""
    if address.startswith("["):
        return address[:address.index("]") + 1]
    return address.rsplit(":", 1)[0] if address.count(":") == 1 else address


class KubeflowEnvironment(ClusterEnvironment):
    """Kubeflow Trainer's PyTorch runtime (a TrainJob) running the script itself, not through
    `torchrun`: the `PET_*` variables it sets for torchrun, one process per node. (Under
    `torchrun`, torchrun's own variables say more, and `TorchrunEnvironment` reads them.)"""

    name = "kubeflow"
    REQUIRED = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT")

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "KubeflowEnvironment":
        per_node = environ.get("PET_NPROC_PER_NODE", "1")
        if per_node != "1":
            raise KerasDistError(f"PET_NPROC_PER_NODE={per_node!r}: the TrainJob asks for several processes per node, "
                                 "which `python train.py` does not start; run the script with `torchrun train.py` "
                                 "(it reads the PET_ variables), or set numProcPerNode: 1")
        rank, size = _first(environ, ["PET_NODE_RANK"]), _first(environ, ["PET_NNODES"])
        if not 0 <= rank < size:
            raise KerasDistError(f"PET_NODE_RANK={rank} is not one of the PET_NNODES={size} nodes; fix the TrainJob's "
                                 "variables")
        return cls(rank=rank, size=size, coordinator=f"{environ['PET_MASTER_ADDR']}:{environ['PET_MASTER_PORT']}")


class KerasDistributionEnvironment(ClusterEnvironment):
    """The variables `keras.distribution.initialize` reads (its JAX coordinator):
    `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the first is the coordinator),
    `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`; the place on
    its machine from `LOCAL_RANK` and `LOCAL_WORLD_SIZE` where the launcher sets them
    (`keras-dist launch` does; Keras's own variables say nothing of machines)."""

    name = "keras_distribution"
    REQUIRED = ("KERAS_DISTRIBUTION_PROCESS_ID", "KERAS_DISTRIBUTION_NUM_PROCESSES")
    KNOWS_LOCAL_SIZE = False

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "KerasDistributionEnvironment":
        addresses = [a for a in environ.get("KERAS_DISTRIBUTION_JOB_ADDRESSES", "").split(",") if a]
        return cls(rank=_first(environ, ["KERAS_DISTRIBUTION_PROCESS_ID"]),
                   size=_first(environ, ["KERAS_DISTRIBUTION_NUM_PROCESSES"]),
                   local_rank=_first(environ, ["LOCAL_RANK"], 0), local_size=_first(environ, ["LOCAL_WORLD_SIZE"], 1),
                   coordinator=addresses[0] if addresses else None)


class LocalEnvironment(ClusterEnvironment):
    """One process, started without a launcher."""

    name = "local"

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "LocalEnvironment":
        return cls()


# Detection order: the first whose launcher is present wins. `horovodrun` under `srun`
# sets both, and Horovod's own variables describe the processes that train. Ray Train's
# `TorchTrainer` sets torchrun's variables, whose `MASTER_PORT` its torch store holds:
# Ray Train's own context wins (`TensorflowTrainer`'s TF_CONFIG, which the TensorFlow
# strategies need, wins over it).
ENVIRONMENTS = (MPIEnvironment, TFConfigEnvironment, RayTrainEnvironment, TorchrunEnvironment, SlurmEnvironment,
                TPUSliceEnvironment, KubeflowEnvironment, KerasDistributionEnvironment, LocalEnvironment)


def detect(environ: Mapping[str, str]) -> ClusterEnvironment:
    """The environment of the launcher that started this process (`LocalEnvironment` if none)."""
    environment = next(cls for cls in ENVIRONMENTS if cls.detect(environ)).from_environ(environ)
    if environment.size < 1 or environment.rank < 0:
        raise KerasDistError(f"{environment.name}: rank {environment.rank} of {environment.size} processes makes no "
                             "sense; fix the launcher's variables")
    return environment
