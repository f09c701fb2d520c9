"""Keras 3 on PyTorch: one process per replica, collectives through `torch.distributed`
or, under `horovodrun` where Horovod was built for PyTorch, through Horovod's torch operations.

Each process runs Keras's own torch steps on its interleaved share of the inputs. The
gradients are all-reduced once per applied update, in flat buckets, before clipping and
the update rule (`keras_dist.optimizer_hooks`); as in DDP, each bucket's all-reduce starts
during the backward pass, as soon as its gradients are ready (`OverlappedGradients`).
Metric states are summed across processes at each epoch's end (and in
every step where a callback reads batch logs), and the chief's initial state is
broadcast to all, as on Horovod. torch.distributed uses gloo on CPUs and NCCL on GPUs
(each process then drives the GPU of its local rank); both collective fronts are thin
classes at the end of this module, and everything above them is shared.

Launch: `keras-dist launch --backend torch -n 2 train.py` (the default under
`KERAS_BACKEND=torch`), `torchrun --nproc-per-node 2 train.py`, `horovodrun -np 2 python
train.py`, or any launcher whose cluster environment names a coordinator (`srun`, Keras's
`KERAS_DISTRIBUTION_*`).
"""

import atexit
import datetime
import itertools
import os
import socket
import time

import numpy as np

from keras_dist import environments, network, timeouts
from keras_dist.environments import ClusterEnvironment
from keras_dist.errors import KerasDistError
from keras_dist.overrides import override, set_while
from keras_dist.strategies.base import GradientOptions, Strategy, bucket_bytes, buckets

# Gradients travel in flat buckets of about this size: few collectives, bounded copies.
BUCKET_BYTES = 25 * 2**20
# DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): the last layers'
# gradients go out while the backward pass goes on, even for a model under 25 MiB.
FIRST_BUCKET_BYTES = 2**20
# After a collective failed, how long each process waits for the others to say they saw
# it fail too: those that do not are the ones that stopped (their machine frozen or gone).
PEERS_SECONDS = 3.0


class TorchDistributedStrategy(Strategy):
    """Data parallelism on Keras's PyTorch backend, one process per replica."""

    name = "torch"
    launcher = "torchrun"
    reduces_in_keras_dist = True
    shares_random_seed = True

    @classmethod
    def detect(cls, environ) -> bool:
        return environments.detect(environ).size > 1

    def __init__(self, environment: ClusterEnvironment | None = None):
        import keras

        super().__init__(environment)

        if keras.backend.backend() != "torch":
            raise KerasDistError(f"backend 'torch' needs Keras on PyTorch, but Keras runs on "
                                 f"{keras.backend.backend()!r}; set KERAS_BACKEND=torch before Python starts")
        import torch

        self._torch = torch
        environment = self.environment
        if environment.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Processes sharing this machine would each size a thread pool for all of it.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // environment.local_size))
        if torch.cuda.is_available() and environment.size > 1:
            torch.cuda.set_device(environment.local_rank % torch.cuda.device_count())
        self._collectives = _collectives(torch, environment)
        self.in_train_step = False  # gradient hooks start collectives only inside train steps
        # id(optimizer) -> its OverlappedGradients. Dropped at each compile, on every process
        # alike: hooks left to the garbage collector would start collectives on some only.
        self._overlapped = {}
        # Numbers optimizers in the order they are distributed, the same on every process:
        # their collectives' names (Horovod matches and caches operations by name).
        self._optimizer_numbers = itertools.count()

    @property
    def rank(self) -> int:
        return self._collectives.rank

    @property
    def size(self) -> int:
        return self._collectives.size

    # --- gradients --------------------------------------------------------------
    def prepare_model(self, model):
        for overlapped in self._overlapped.values():
            overlapped.remove()
        self._overlapped.clear()
        if self.size > 1:
            # Marks the model's train steps (Keras's or the script's own), the only place a
            # backward pass may start collectives: a backward on one process alone (the
            # chief's own analysis after fit) must not.
            step = model.train_step

            def train_step(data):
                with set_while(self, "in_train_step", True):
                    return step(data)

            override(model, "train_step", train_step)
        return model

    def distribute_optimizer(self, optimizer, options: GradientOptions) -> None:
        import keras

        from keras_dist import optimizer_hooks

        torch = self._torch
        if self.size == 1:
            return
        # Where the optimizer rescales or accumulates gradients first, the tensors it
        # reduces are never the ones backward produced: reduce them at the update only.
        overlaps = not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
            not optimizer.gradient_accumulation_steps and optimizer.loss_scale_factor is None
        name = f"optimizer{next(self._optimizer_numbers)}"

        def allreduce_gradients(grads):
            present = [g for g in grads if g is not None]
            overlapped = self._overlapped.get(id(optimizer))
            if overlapped is not None:
                reduced = iter(overlapped.reduce(present))
            else:
                reduced = iter(self._allreduce_in_buckets(present, options, f"{name}.gradients"))
                if overlaps:  # built at the first update, when the optimizer knows its variables
                    self._overlapped[id(optimizer)] = OverlappedGradients(self, optimizer._trainable_variables, options,
                                                                          f"{name}.overlapped")
            return [None if g is None else next(reduced) for g in grads]

        def all_finite(is_finite):
            flag = torch.as_tensor(is_finite, dtype=torch.int32, device=self._collectives.device).reshape(1)
            return self._collectives.min(flag)[0].to(torch.bool)

        optimizer_hooks.reduce_gradients_before_update(optimizer, allreduce_gradients, all_finite)

    def _allreduce_in_buckets(self, tensors, options, name):
        """Each tensor summed (or averaged) over processes, through a few flat collectives
        named `name.0`, `name.1`..."""
        out = []
        for k, bucket in enumerate(tensor_buckets(tensors)):
            out += self._finish_allreduce(self._start_allreduce(bucket, options, f"{name}.{k}"), bucket, options)
        return out

    def _start_allreduce(self, tensors, options, name):
        """Starts summing `tensors` (one dtype) over processes as one flat tensor; `(handle, flat)`.

        `name` is the same on every process and at every step for the same bucket.
        """
        from torch._utils import _flatten_dense_tensors

        flat = _flatten_dense_tensors(tensors)
        wire = flat.to(self._torch.float16) if options.compression == "fp16" else flat
        return self._collectives.start_sum(wire, name), wire

    def _finish_allreduce(self, started, tensors, options):
        """Waits for `_start_allreduce`; the summed (or averaged) tensors, shaped as `tensors`."""
        from torch._utils import _unflatten_dense_tensors

        flat = self._collectives.wait(*started).to(tensors[0].dtype)
        if options.reduction == "mean":
            flat /= self.size
        return list(_unflatten_dense_tensors(flat, tensors))

    def sum_across_processes_in_step(self, tensors):
        tensors = [self._torch.as_tensor(t) for t in tensors]
        if self.size == 1:
            return tensors
        return self._allreduce_in_buckets(tensors, GradientOptions(reduction="sum"), "metric_states_in_step")

    # --- host-side collectives ----------------------------------------------------
    def allgather_object(self, obj) -> list:
        return self._collectives.allgather_object(obj) if self.size > 1 else [obj]

    def broadcast_object(self, obj, root: int = 0):
        return self._collectives.broadcast_object(obj, root) if self.size > 1 else obj

    def broadcast_variables(self, variables, root: int = 0) -> None:
        if self.size == 1:
            return
        for variable in variables:
            value = variable.value
            wire = value.detach().to(self._collectives.device)
            self._collectives.broadcast_(wire, root)
            with self._torch.no_grad():
                value.copy_(wire.to(value.device))

    def sum_arrays(self, arrays):
        arrays = [np.asarray(a) for a in arrays]
        if not arrays or self.size == 1:
            return arrays
        torch = self._torch
        summed = self._allreduce_in_buckets([torch.from_numpy(np.array(a, np.float64)).to(self._collectives.device)
                                             for a in arrays], GradientOptions(reduction="sum"), "sum_arrays")
        return [s.cpu().numpy().reshape(a.shape).astype(a.dtype) for s, a in zip(summed, arrays)]

    def barrier(self) -> None:
        if self.size > 1:
            self._collectives.barrier()

    def describe(self) -> dict:
        # How many gradient buckets began their all-reduce during a backward pass: 0 means
        # no overlap (loss scaling, gradient accumulation, or a step without backward).
        return {**super().describe(), "collectives": self._collectives.name,
                "buckets_started_in_backward": sum(o.started_in_backward for o in self._overlapped.values())}


def _collectives(torch, environment):
    """Horovod's torch operations under horovodrun where Horovod was built for PyTorch, else torch.distributed."""
    if "HOROVOD_RANK" in os.environ:  # horovodrun, or `keras-dist launch --backend horovod`
        try:
            import horovod.torch as hvd
        except Exception:  # not installed, or built without PyTorch (Horovod raises its own errors)
            pass
        else:
            return HorovodTorchCollectives(torch, hvd)
    return TorchDistributedCollectives(torch, environment)


class TorchDistributedCollectives:
    """`torch.distributed`: gloo on CPUs (CPU tensors), NCCL on GPUs (the local rank's GPU).

    Starts the default process group where the launcher started several processes and
    the script has not started one itself.
    """

    name = "torch.distributed"

    def __init__(self, torch, environment):
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
            self.timeout = timeouts.first_steps()
            advertised = network.choose_interface(os.environ, coordinator)
            try:
                dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                        init_method=f"tcp://{coordinator}", rank=environment.rank,
                                        world_size=environment.size, timeout=datetime.timedelta(seconds=self.timeout))
            except RuntimeError as exc:  # DistBackendError and DistStoreError too
                raise KerasDistError(
                    f"rank {environment.rank} did not connect to the job at {coordinator} within {self.timeout:g} s, "
                    f"advertising {advertised or socket.gethostname()} to its peers ({_first_line(exc)}); set "
                    "GLOO_SOCKET_IFNAME (NCCL_SOCKET_IFNAME on GPUs) to the interface the other machines reach, "
                    f"or raise {timeouts.STEP_TIMEOUT_VAR} if the processes start that far apart") from None
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
    def rank(self):
        return self._dist.get_rank() if self._dist.is_initialized() else 0

    @property
    def size(self):
        return self._dist.get_world_size() if self._dist.is_initialized() else 1

    def start_sum(self, tensor, name):
        """Starts summing `tensor` in place over processes; a handle for `wait`. `name`
        (used by Horovod) is ignored: torch.distributed matches collectives by order."""
        return self._dist.all_reduce(tensor, async_op=True)

    def wait(self, handle, tensor):
        """Waits for `start_sum`; the summed tensor."""
        try:
            handle.wait()
        except RuntimeError as exc:  # a peer timed out or closed its connection
            if self._store is None:
                raise
            raise KerasDistError(self._who_stopped(exc)) from None
        return tensor

    def _who_stopped(self, error) -> str:
        """A one-line account of a failed collective that names the processes that stopped.

        Each process that sees its collective fail notes so in the job's store; the ranks
        that have not after `PEERS_SECONDS` stopped (a frozen or lost machine). The store
        itself not answering means the coordinator's machine stopped.
        """
        store = self._store
        store.set_timeout(datetime.timedelta(seconds=PEERS_SECONDS))
        try:
            store.set(f"keras_dist/failed/{self.rank}", "1")
            time.sleep(PEERS_SECONDS)
            silent = [r for r in range(self.size) if not store.check([f"keras_dist/failed/{r}"])]
            stopped = ", ".join(f"rank {r} on {store.get(f'keras_dist/host/{r}').decode()}" for r in silent)
        except RuntimeError:
            stopped = f"the job's coordinator at {self._coordinator}"
        return (f"{stopped or 'a peer'} stopped answering within {self.timeout:g} s ({_first_line(error)}): its "
                f"machine froze, lost its network or ended; or raise {timeouts.STEP_TIMEOUT_VAR} if a step "
                "or the chief's own work between steps takes that long")

    def min(self, tensor):
        self._dist.all_reduce(tensor, op=self._dist.ReduceOp.MIN)
        return tensor

    def allgather_object(self, obj):
        gathered = [None] * self.size
        self._dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj, root):
        box = [obj]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def broadcast_(self, tensor, root):
        self._dist.broadcast(tensor, src=root)

    def barrier(self):
        self._dist.barrier()


class HorovodTorchCollectives:
    """Horovod's torch operations (`horovod.torch`): Gloo, MPI or NCCL, as Horovod was built."""

    name = "horovod"

    def __init__(self, torch, hvd):
        self._hvd = hvd
        hvd.init()
        self.device = torch.device("cuda" if torch.cuda.is_available() and hvd.nccl_built() else "cpu")

    @property
    def rank(self):
        return self._hvd.rank()

    @property
    def size(self):
        return self._hvd.size()

    def start_sum(self, tensor, name):
        # A name stable across steps lets Horovod's response cache skip the coordinator's
        # negotiation; an unnamed operation gets a new name, and a full negotiation, each time.
        return self._hvd.allreduce_async_(tensor, name=name, op=self._hvd.Sum)

    def wait(self, handle, tensor):
        return self._hvd.synchronize(handle)

    def min(self, tensor):
        return self._hvd.allreduce(tensor, op=self._hvd.Min)

    # Named: Horovod's default name is the object's type, and processes that pass objects
    # of different types (the chief's seed, the others' None) would wait for each other forever.
    def allgather_object(self, obj):
        return self._hvd.allgather_object(obj, name="keras_dist.allgather_object")

    def broadcast_object(self, obj, root):
        return self._hvd.broadcast_object(obj, root_rank=root, name="keras_dist.broadcast_object")

    def broadcast_(self, tensor, root):
        self._hvd.broadcast_(tensor, root_rank=root)

    def barrier(self):
        self._hvd.barrier()


def _first_line(error) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _destroy_process_group(dist):
    if dist.is_initialized():
        dist.destroy_process_group()


def tensor_buckets(tensors, first: int | None = None):
    """`tensors` in consecutive runs of one dtype of about `bucket_bytes()` (`buckets`); the first run
    of about `first` bytes where the user chose no bucket size."""
    limit = bucket_bytes(BUCKET_BYTES)
    runs = buckets([t.numel() * t.element_size() for t in tensors], [t.dtype for t in tensors], limit,
                   first if limit == BUCKET_BYTES else None)
    return [[tensors[i] for i in run] for run in runs]


class OverlappedGradients:
    """One optimizer's gradients all-reduced during the backward pass, bucket by bucket, as DDP does.

    Buckets hold the optimizer's variables in reverse order, as backward yields the last
    layers' gradients first. A hook on each variable notes its gradient ready; once every
    gradient of the next bucket is, that bucket's asynchronous all-reduce starts. Buckets
    start in the same order on every process, so the collectives match. At the update,
    `reduce` starts the buckets still waiting, waits for all, and returns the reduced
    value of each gradient that is the very tensor a bucket carried, unchanged since; any
    other (a custom step's own tensors, a second backward) is reduced there and then.

    Args:
        strategy: the `TorchDistributedStrategy`.
        variables: the Keras variables the optimizer updates.
        options: the `GradientOptions`.
        name: the prefix of its collectives' names, the same on every process.
    """

    def __init__(self, strategy, variables, options, name):
        self.strategy, self.options, self.name = strategy, options, name
        self.params = [v.value for v in variables][::-1]
        self.buckets = []  # lists of indices into params
        for run in tensor_buckets(self.params, first=FIRST_BUCKET_BYTES):
            start = sum(len(b) for b in self.buckets)
            self.buckets.append(list(range(start, start + len(run))))
        self.bucket_of = [k for k, bucket in enumerate(self.buckets) for _ in bucket]
        self.index_of = {id(p): i for i, p in enumerate(self.params)}
        self.hooks = [p.register_post_accumulate_grad_hook(self._ready) for p in self.params]
        self.started_in_backward = 0
        self._new_round()

    def _new_round(self):
        self.waiting = [set(bucket) for bucket in self.buckets]
        self.started = []  # per started bucket: ((work, wire), [(gradient, its version)])

    def _ready(self, param):
        if not self.strategy.in_train_step:
            return
        index = self.index_of[id(param)]
        if len(self.started) > self.bucket_of[index]:
            self._wait_all()  # another backward in the same step (a GAN's): start over
            self._new_round()
        self.waiting[self.bucket_of[index]].discard(index)
        while len(self.started) < len(self.buckets) and not self.waiting[len(self.started)]:
            self._start(len(self.started))
            self.started_in_backward += 1

    def _start(self, k):
        torch = self.strategy._torch
        grads = [self.params[i].grad for i in self.buckets[k]]
        tensors = [torch.zeros_like(self.params[i]) if g is None else g for i, g in zip(self.buckets[k], grads)]
        started = self.strategy._start_allreduce(tensors, self.options, f"{self.name}.{k}")
        self.started.append((started, [(g, None if g is None else g._version) for g in grads]))

    def _wait_all(self):
        for started, _ in self.started:
            self.strategy._collectives.wait(*started)

    def reduce(self, grads):
        """`grads` (this step's) each summed or averaged over processes."""
        if self.started:  # hooks fired this step, on every process: finish every bucket
            while len(self.started) < len(self.buckets):
                self._start(len(self.started))
        carried = {}
        for k, (started, sources) in enumerate(self.started):
            values = self.strategy._finish_allreduce(started, [self.params[i] for i in self.buckets[k]], self.options)
            carried.update({id(g): (g, version, value) for (g, version), value in zip(sources, values) if g is not None})
        self._new_round()
        out, late = [], []
        for grad in grads:
            carried_grad, version, value = carried.get(id(grad), (None, None, None))
            if carried_grad is grad and grad._version == version:
                out.append(value)
            else:
                out.append(None)
                late.append(grad)
        late = iter(self.strategy._allreduce_in_buckets(late, self.options, f"{self.name}.late"))
        return [next(late) if value is None else value for value in out]

    def remove(self):
        """Removes the hooks, after any all-reduce still running."""
        self._wait_all()
        for hook in self.hooks:
            hook.remove()
