"""torch.distributed (gloo on CPUs, NCCL on GPUs), and what every torch engine shares."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from keras_dist import network, timeouts
from keras_dist.collectives import PEERS_SECONDS, Collectives, flatten, unflatten
from keras_dist.environments import ClusterEnvironment
from keras_dist.errors import KerasDistError, PeerFailure, first_line

logger = logging.getLogger("keras_dist")


class TorchTensors(Collectives):
    """A torch engine: tensor operations (`start_sum`, `wait`, `min`, `broadcast_`) on
    `device`, which the PyTorch strategy's gradient buckets use too, and the host-side
    collectives built on them."""

    device: Any = None

    def start_sum(self, tensor: Any, name: str) -> Any:
        """Starts summing `tensor` in place over processes; a handle for `wait`. `name` is
        the same on every process for the same operation (Horovod caches by it)."""
        raise NotImplementedError

    def wait(self, handle: Any, tensor: Any) -> Any:
        """Waits for `start_sum`; the summed tensor."""
        raise NotImplementedError

    def min(self, tensor: Any) -> Any:
        """`tensor`'s elementwise minimum over processes."""
        raise NotImplementedError

    def broadcast_(self, tensor: Any, root: int) -> None:
        """Overwrites `tensor` in place with `root`'s."""
        raise NotImplementedError

    def all_gather_(self, out: Any, part: Any, name: str) -> None:
        """Fills the flat `out` with every process's flat `part` (all of one length), in rank order."""
        raise NotImplementedError

    def reduce_scatter_(self, out: Any, whole: Any, name: str) -> None:
        """Fills `out` with this process's part of `whole` (flat, `size` equal parts) summed over processes."""
        raise NotImplementedError

    def _sum_arrays(self, arrays: list[np.ndarray]) -> list[np.ndarray]:
        import torch

        flat = torch.from_numpy(flatten(arrays)).to(self.device)
        return unflatten(self.wait(self.start_sum(flat, "keras_dist.sum_arrays"), flat).cpu().numpy(), arrays)

    def _broadcast_variables(self, variables: list, root: int) -> None:
        import torch

        for variable in variables:
            value = variable.value
            wire = value.detach().to(self.device)
            self.broadcast_(wire, root)
            with torch.no_grad():
                value.copy_(wire.to(value.device))


def _engine(torch: Any, environment: ClusterEnvironment) -> str:
    """NCCL where each process on this machine has a GPU of its own, else gloo.

    NCCL refuses two processes on one GPU (canary: tests/gpu/test_gpu.py::
    test_nccl_refuses_two_processes_on_one_gpu); gloo all-reduces their CUDA gradients
    through host memory instead.
    """
    if not torch.cuda.is_available():
        return "gloo"
    gpus = torch.cuda.device_count()
    if environment.local_size <= gpus:
        return "nccl"
    if environment.rank == 0:
        logger.warning("keras_dist: %d processes share %d GPU%s on this machine and NCCL needs one each, so "
                       "gradients travel over gloo through host memory; start one process per GPU for NCCL",
                       environment.local_size, gpus, "s" if gpus > 1 else "")
    return "gloo"


class TorchDistributed(TorchTensors):
    """`torch.distributed`: gloo on CPUs (CPU tensors), NCCL on GPUs (the local rank's GPU).

    Starts the default process group where the launcher started several processes and
    the script has not started one itself. The environment's `job_address` (this process's
    interface to the job) goes into the error that says which address it advertised.
    """

    name = "torch.distributed"

    def __init__(self, torch: Any, environment: ClusterEnvironment, step_timeout: timeouts.StepTimeout):
        import torch.distributed as dist

        self._dist = dist
        self._store = None  # where keras_dist started the process group: the job's store
        if not dist.is_initialized() and environment.size > 1:
            coordinator = environment.rendezvous()
            if coordinator is None:
                raise KerasDistError(f"the {environment.name} launcher names no coordinator for torch.distributed; "
                                     "set MASTER_ADDR and MASTER_PORT, or launch with `keras-dist launch --backend torch`")
            # A collective cannot tell a frozen peer from one busy with the chief's own work
            # (a checkpoint) between steps, so it waits as long as a first step may take:
            # bounded, where gloo's default is 30 minutes.
            self.timeout = step_timeout.first
            try:
                dist.init_process_group(_engine(torch, environment),
                                        init_method=f"tcp://{coordinator}", rank=environment.rank,
                                        world_size=environment.size, timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as exc:  # DistBackendError and DistStoreError too
                raise KerasDistError(
                    f"rank {environment.rank} did not connect to the job at {coordinator} within {self.timeout:g} s, "
                    f"advertising {environment.job_address or socket.gethostname()} to its peers ({first_line(exc)}); set "
                    "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the interface the other machines reach, "
                    f"or raise {timeouts.STEP_TIMEOUT_VARIABLE} if the processes start that far apart") from None
            self._coordinator = coordinator
            self._store = dist.distributed_c10d._get_default_store()
            self._store.set(f"keras_dist/host/{environment.rank}", socket.gethostname())
            # A process group left to interpreter shutdown can abort the process after the
            # script ended well ("terminate called without an active exception": gloo's
            # threads outlive Python; pytorch/pytorch#190489). keras_dist created it, so
            # keras_dist destroys it while Python is still whole.
            atexit.register(_destroy_process_group, dist)
        nccl = dist.is_initialized() and dist.get_backend() == "nccl"
        self.device = torch.device("cuda" if nccl else "cpu")

    @property
    def rank(self) -> int:
        return self._dist.get_rank() if self._dist.is_initialized() else 0

    @property
    def size(self) -> int:
        return self._dist.get_world_size() if self._dist.is_initialized() else 1

    def start_sum(self, tensor: Any, name: str) -> Any:
        # torch.distributed matches collectives by their order, not by name.
        return self._dist.all_reduce(tensor, async_op=True)

    def wait(self, handle: Any, tensor: Any) -> Any:
        with self._peers_answer():
            handle.wait()
        return tensor

    @contextlib.contextmanager
    def _peers_answer(self) -> Iterator[None]:
        """Turns a collective that failed because a peer timed out or closed its connection
        into one `PeerFailure` line (where keras_dist started the process group: its store
        tells who stopped), instead of torch's traceback."""
        try:
            yield
        except RuntimeError as exc:
            if self._store is None:
                raise
            raise self._who_stopped(exc) from None

    def _who_stopped(self, error: Exception) -> PeerFailure:
        """A failed collective's account, naming the processes that stopped.

        Each process that sees its collective fail notes so in the job's store; the ranks
        that have not after `PEERS_SECONDS` stopped (a frozen or lost machine). The store
        itself not answering means the coordinator's machine stopped; its port refusing
        connections, that rank 0 (which serves it) exited.
        """
        cause = first_line(error)
        # keras_dist's own process group: rank 0 serves the store, whose port closes when it
        # exits (then asking the store would print torch's C++ stack trace). Rank 0 may
        # still be ending when the collective fails: looked at again after the wait.
        exited = PeerFailure([f"rank 0 (the job's coordinator at {self._coordinator})"], None,
                             "run the same command again to resume from the last backup", cause=cause, exited=True)
        if network.refuses(self._coordinator, PEERS_SECONDS):
            return exited
        store = self._store
        store.set_timeout(datetime.timedelta(seconds=PEERS_SECONDS))
        try:
            store.set(f"keras_dist/failed/{self.rank}", "1")
            time.sleep(PEERS_SECONDS)
            if network.refuses(self._coordinator, PEERS_SECONDS):
                return exited
            silent = [r for r in range(self.size) if not store.check([f"keras_dist/failed/{r}"])]
            stopped = [f"rank {r} on {store.get(f'keras_dist/host/{r}').decode()}" for r in silent]
        except RuntimeError:
            stopped = [f"the job's coordinator at {self._coordinator}"]
        return PeerFailure(stopped, f"{self.timeout:g} s", f"or raise {timeouts.STEP_TIMEOUT_VARIABLE} if a step or the "
                           "chief's own work between steps takes that long", cause=cause)

    def min(self, tensor: Any) -> Any:
        with self._peers_answer():
            self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN)
        return tensor

    def broadcast_(self, tensor: Any, root: int) -> None:
        with self._peers_answer():
            self._dist.broadcast(tensor, src=root)

    def all_gather_(self, out: Any, part: Any, name: str) -> None:
        with self._peers_answer():
            # torch 2.13 renamed all_gather_into_tensor (which now warns) to all_gather_single.
            (getattr(self._dist, "all_gather_single", None) or self._dist.all_gather_into_tensor)(out, part)

    def reduce_scatter_(self, out: Any, whole: Any, name: str) -> None:
        with self._peers_answer():
            (getattr(self._dist, "reduce_scatter_single", None) or self._dist.reduce_scatter_tensor)(out, whole)

    def _allgather_object(self, obj: Any) -> list:
        gathered = [None] * self.size
        with self._peers_answer():
            self._dist.all_gather_object(gathered, obj)
        return gathered

    def _broadcast_object(self, obj: Any, root: int) -> Any:
        box = [obj]
        with self._peers_answer():
            self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def _barrier(self) -> None:
        with self._peers_answer():
            self._dist.barrier()


def _destroy_process_group(dist: Any) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
