"""Keras 3 on PyTorch: one process per replica, collectives through `torch.distributed`
or, under `horovodrun` where Horovod was built for PyTorch, through Horovod's torch operations.

Each process runs Keras's own torch steps on its interleaved share of the inputs. The
gradients are all-reduced once per applied update, in flat buckets, before clipping and
the update rule (`keras_dist.optimizer_hooks`); as in DDP, each bucket's all-reduce starts
during the backward pass, as soon as its gradients are ready (`OverlappedGradients`).
Metric states are summed across processes at each epoch's end (and in
every step where a callback reads batch logs), and the chief's initial state is
broadcast to all, as on Horovod. torch.distributed uses gloo on CPUs and NCCL on GPUs
(each process then drives the GPU of its local rank; gloo where processes outnumber GPUs); both collective fronts are thin
classes in `keras_dist.collectives`, and everything here is shared.

Launch: `keras-dist launch --backend torch -n 2 train.py` (the default under
`KERAS_BACKEND=torch`), `torchrun --nproc-per-node 2 train.py`, `horovodrun -np 2 python
train.py`, or any launcher whose cluster environment names a coordinator (`srun`, Keras's
`KERAS_DISTRIBUTION_*`).
"""

import contextlib
import itertools
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keras_dist import keras_internals, keras_workarounds_torch, timeouts
from keras_dist.collectives.horovod import NO_BFLOAT16, HorovodTorch
from keras_dist.collectives.torch_distributed import TorchDistributed
from keras_dist.environments import ClusterEnvironment, MPIEnvironment
from keras_dist.errors import KerasDistError
from keras_dist.overrides import override, set_while
from keras_dist.replicas import MetricStates
from keras_dist.settings import Settings
from keras_dist.split_creation import NOT_SAVED_WHOLE
from keras_dist.strategies.base import GradientOptions, ProcessSetup, Strategy, bucket_bytes, buckets


if TYPE_CHECKING:
    import keras
    import torch

    from keras_dist.collectives import Collectives

# Gradients travel in flat buckets of about this size: few collectives, bounded copies.
BUCKET_BYTES = 25 * 2**20
# gradient_compression -> the torch dtype buckets travel in.
WIRE_DTYPES = {"fp16": "float16", "bf16": "bfloat16"}
# DDP's first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): the last layers'
# gradients go out while the backward pass goes on, even for a model under 25 MiB.
FIRST_BUCKET_BYTES = 2**20


class TorchDistributedSetup(ProcessSetup):
    """What backend 'torch' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        return detected.size > 1

    @classmethod
    def prepare_process(cls, environment: ClusterEnvironment, chosen: Settings) -> None:
        # At import, before the script builds its model: Keras puts variables on the current GPU.
        _take_local_gpu(environment)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str]:
        # torch.distributed takes one timeout per process group, and a collective cannot tell
        # a frozen peer from a chief busy with a checkpoint between steps: the longer one.
        # (Under horovodrun, Horovod's collectives: as backend 'horovod'.)
        return (f"{policy.first:g} s",) * 3


class TorchDistributedStrategy(Strategy):
    """Data parallelism on Keras's PyTorch backend, one process per replica."""

    name = "torch"
    process_setup = TorchDistributedSetup
    reduces_in_keras_dist = True
    shares_random_seed = True
    shards_optimizer_state = True
    shards_weights = True

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        import keras

        from keras_dist.fault_tolerance.checkpoint_io import CheckpointIO

        super().__init__(environment, chosen)

        if keras.backend.backend() != "torch":
            raise KerasDistError(f"backend 'torch' needs Keras on PyTorch, but Keras runs on "
                                 f"{keras.backend.backend()!r}; set KERAS_BACKEND=torch before Python starts")
        import torch

        self._torch = torch
        environment = self.environment
        if environment.local_size > 1 and "OMP_NUM_THREADS" not in self.settings.variables:
            # Processes sharing this machine would each size a thread pool for all of it.
            torch.set_num_threads(environment.threads_per_process)
        _take_local_gpu(environment)  # again: `keras_dist.init(backend="torch")` chose this strategy after import
        self.collectives = _collectives(torch, environment, self.step_timeout)
        self.in_train_step = False  # gradient hooks start collectives only inside train steps
        # id(optimizer) -> its OverlappedGradients. Dropped at each compile, on every process
        # alike: hooks left to the garbage collector would start collectives on some only.
        self._overlapped = {}
        # Numbers optimizers in the order they are distributed, the same on every process:
        # their collectives' names (Horovod matches and caches operations by name).
        self._optimizer_numbers = itertools.count()
        self.metric_states = MetricStates(self, sum_in_step=self._sum_metric_states_in_step)
        # id(optimizer) -> its SplitWeights (shard="weights"); the one split in the fit under way
        # (or left split by a fit that failed, gathered at the next fit's start).
        self._split_weights = {}
        self._splitting = None
        self.fitting = False
        # Under shard="weights", a checkpoint in fit gathers the split weights a layer at a
        # time as the chief writes it, every other process's stand-in following its gathers;
        # the script's saves of a model split for good likewise (`saves_by_layer`).
        self.checkpoint_io = CheckpointIO(whole_weights=self._whole_weights, split_weight_ids=self._split_weight_ids,
                                          saves_within=self._whole_for_a_save, saves_by_layer=self._split_for_good,
                                          checkpoints_within=self._whole_for_a_checkpoint, restores_within=True)

    # --- gradients --------------------------------------------------------------
    def prepare_model(self, model: "keras.Model") -> "keras.Model":
        earlier = self._split_weights.pop(id(getattr(model, "optimizer", None)), None)  # compiled again: its slices go
        if earlier is not None and earlier.for_good:  # the weights stay in their slices, the next SplitWeights' own
            earlier.join(gather=False)
        for overlapped in self._overlapped.values():
            overlapped.remove()
        self._overlapped.clear()
        if self.size > 1:
            keras_workarounds_torch.one_reduction_per_step(model)
            # Marks the model's train steps (Keras's or the script's own), the only place a
            # backward pass may start collectives: a backward on one process alone (the
            # chief's own analysis after fit) must not.
            step = model.train_step

            def train_step(data):
                with set_while(self, "in_train_step", True):
                    return step(data)

            override(model, "train_step", train_step)
        return model

    def distribute_optimizer(self, optimizer: "keras.optimizers.Optimizer", options: GradientOptions) -> None:
        import keras

        from keras_dist import optimizer_hooks, optimizer_sharding

        torch = self._torch
        if options.compression == "bf16" and isinstance(self.collectives, HorovodTorch):
            raise KerasDistError(NO_BFLOAT16)
        if self.size == 1:
            return
        # Where the optimizer rescales or accumulates gradients first, the tensors it
        # reduces are never the ones backward produced: reduce them at the update only.
        overlaps = not isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and \
            not optimizer.gradient_accumulation_steps and optimizer.loss_scale_factor is None
        name = f"optimizer{next(self._optimizer_numbers)}"
        if options.shard == "weights":
            from keras_dist.strategies.torch_split_weights import SplitWeights

            if options.compression is not None or options.reduction != "mean":
                raise KerasDistError("shard='weights' averages each gradient's slices in full precision: drop "
                                     "gradient_compression and gradient_reduction, or use shard='optimizer'")
            self._split_weights[id(optimizer)] = SplitWeights(self.collectives, optimizer, lambda: self.in_train_step)
            return
        if options.shard == "optimizer":
            optimizer_sharding.shard_state(
                optimizer, self,
                lambda grads: self._allreduce_in_buckets(grads, options, f"{name}.gradients"),
                self._broadcast_from_owners)
            return

        def allreduce_gradients(grads):
            present = [g for g in grads if g is not None]
            overlapped = self._overlapped.get(id(optimizer))
            if overlapped is not None:
                reduced = iter(overlapped.reduce(present))
            else:
                reduced = iter(self._allreduce_in_buckets(present, options, f"{name}.gradients"))
                if overlaps:  # built at the first update, when the optimizer knows its variables
                    self._overlapped[id(optimizer)] = OverlappedGradients(self, keras_internals.optimizer_variables(optimizer), options,
                                                                          f"{name}.overlapped")
            return [None if g is None else next(reduced) for g in grads]

        def all_finite(is_finite):
            flag = torch.as_tensor(is_finite, dtype=torch.int32, device=self.collectives.device).reshape(1)
            return self.collectives.min(flag)[0].to(torch.bool)

        optimizer_hooks.reduce_gradients_before_update(optimizer, allreduce_gradients, all_finite)

    # --- shard="weights": split while fit runs, or for good ---------------------------
    def creating_split_weights(self) -> contextlib.AbstractContextManager[None]:
        if self.size == 1:
            return contextlib.nullcontext()
        from keras_dist.strategies.torch_split_creation import built_split

        return built_split(self.rank, self.size)

    def after_compile(self, model: "keras.Model") -> None:
        from keras_dist import split_creation

        split = self._split_weights.get(id(model.optimizer))
        if split is not None and split_creation.built_split(model):
            split.split_for_good(model)

    def after_initial_sync(self, model: "keras.Model") -> None:
        split = self._split_weights.get(id(model.optimizer))
        # Not for an evaluate before any fit, nor for a model split for good (split already).
        if split is not None and not split.for_good and self.size > 1 and self.fitting:
            split.split(model)
            self._splitting = split

    def run_loop(self, method: str, model: "keras.Model", keras_method: Callable[..., Any], arguments: dict) -> Any:
        if method != "fit":
            return keras_method(**arguments)
        if self._split_weights.get(id(model.optimizer)) is not None:
            _check_checkpoints_of_split(arguments.get("callbacks"))
        if self._splitting is not None:
            # A fit that failed left it split: every process is here now.
            self._splitting.join()
            self._splitting = None
        ended = False
        try:
            with set_while(self, "fitting", True):
                result = keras_method(**arguments)
            ended = True
            return result
        finally:
            if self._splitting is not None and ended:
                # Whole again for evaluate, predict and the script; not after a failure, whose
                # peers may be gone (a gather would wait for them): the next fit gathers it.
                self._splitting.join()
                self._splitting = None

    def _split_of(self, model: "keras.Model") -> Any:
        """The model's `SplitWeights` where its weights are split now (in fit, or for good)."""
        split = self._split_weights.get(id(getattr(model, "optimizer", None)))
        return split if split is not None and split.active else None

    def _whole_weights(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        split = self._split_of(model)
        return split.whole() if split is not None else contextlib.nullcontext()

    def _whole_for_a_save(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        split = self._split_for_good(model)
        if split is not None and not split.leading:
            raise KerasDistError(NOT_SAVED_WHOLE)
        return self._whole_weights(model)

    def _whole_for_a_checkpoint(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        # The chief leads a checkpoint's gathers, a layer at a time, and every other process's
        # stand-in follows: its own decision to save (save_best_only) may differ from the
        # chief's wherever their counters do.
        from keras_dist import optimizer_sharding

        split = self._split_of(model)
        if split is not None:
            return split.checkpoint_together()
        return optimizer_sharding.checkpoints_led_by_the_chief(model, self)

    def _split_for_good(self, model: "keras.Model") -> Any:
        split = self._split_of(model)
        return split if split is not None and split.for_good else None

    def _split_weight_ids(self) -> Collection[int]:
        return {key for split in self._split_weights.values() if split.active for key in split.slices}

    def process_local_steps(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        # Each process evaluates its own shard, in as many steps as it has: no per-layer gathers.
        return self._whole_weights(model)

    def _broadcast_from_owners(self, variables: list, owners: list[int]) -> None:
        """Each variable's value from its owner, one broadcast per owner and dtype."""
        torch = self._torch
        for root in range(self.size):
            owned = [v for v, owner in zip(variables, owners) if owner == root]
            for dtype in sorted({v.value.dtype for v in owned}, key=str):
                group = [v.value for v in owned if v.value.dtype == dtype]
                wire = torch.cat([value.detach().reshape(-1) for value in group]).to(self.collectives.device)
                self.collectives.broadcast_(wire, root)
                with torch.no_grad():
                    for value, part in zip(group, wire.split([value.numel() for value in group])):
                        value.copy_(part.view_as(value).to(value.device))

    def _allreduce_in_buckets(self, tensors, options, name):
        """Each tensor summed (or averaged) over processes, through a few flat collectives
        named `name.0`, `name.1`..."""
        out = []
        for k, bucket in enumerate(tensor_buckets(tensors, self.settings)):
            out += self._finish_allreduce(self._start_allreduce(bucket, options, f"{name}.{k}"), bucket, options)
        return out

    def _start_allreduce(self, tensors, options, name):
        """Starts summing `tensors` (one dtype) over processes as one flat tensor; `(handle, flat)`.

        `name` is the same on every process and at every step for the same bucket.
        """
        torch = self._torch
        # One pass: the copy into the bucket is the cast to the wire's dtype.
        dtype = getattr(torch, WIRE_DTYPES[options.compression]) if options.compression else tensors[0].dtype
        wire = torch.empty(sum(t.numel() for t in tensors), device=tensors[0].device, dtype=dtype)
        torch.cat([t.reshape(-1) for t in tensors], out=wire)
        return self.collectives.start_sum(wire, name), wire

    def _finish_allreduce(self, started, tensors, options):
        """Waits for `_start_allreduce`; the summed (or averaged) tensors, shaped as `tensors`."""
        from torch._utils import _unflatten_dense_tensors

        wire = self.collectives.wait(*started)
        divisor = self.size if options.reduction == "mean" else 1
        if wire.dtype == tensors[0].dtype:
            flat = wire.div_(divisor) if divisor != 1 else wire
        else:  # one pass back from the wire's dtype, averaged on the way
            flat = self._torch.empty(wire.shape, dtype=tensors[0].dtype, device=wire.device)
            self._torch.div(wire, divisor, out=flat)
        return list(_unflatten_dense_tensors(flat, tensors))

    def _sum_metric_states_in_step(self, tensors: Sequence[Any]) -> list["torch.Tensor"]:
        tensors = [self._torch.as_tensor(t) for t in tensors]
        if self.size == 1:
            return tensors
        return self._allreduce_in_buckets(tensors, GradientOptions(reduction="sum"), "metric_states_in_step")

    def describe(self) -> dict:
        # How many gradient buckets began their all-reduce during a backward pass: 0 means
        # no overlap (loss scaling, gradient accumulation, or a step without backward).
        return {**super().describe(),
                "buckets_started_in_backward": sum(o.started_in_backward for o in self._overlapped.values())}


def _take_local_gpu(environment: ClusterEnvironment) -> None:
    """Makes the GPU of this process's local rank the current one, where GPUs are visible;
    processes that outnumber the GPUs share them in turn (`TorchDistributed` then uses gloo)."""
    import torch

    if environment.size > 1 and torch.cuda.is_available():
        torch.cuda.set_device(environment.local_rank % torch.cuda.device_count())


def _collectives(torch: Any, environment: ClusterEnvironment, step_timeout: timeouts.StepTimeout) -> "Collectives":
    """Horovod's torch operations under horovodrun where Horovod was built for PyTorch, else torch.distributed."""
    if isinstance(environment, MPIEnvironment) and environment.horovodrun:
        try:
            import horovod.torch as hvd
        except Exception:  # not installed, or built without PyTorch (Horovod raises its own errors)
            pass
        else:
            return HorovodTorch(torch, hvd)
    return TorchDistributed(torch, environment, step_timeout)


def tensor_buckets(tensors: Sequence["torch.Tensor"], chosen: Settings, first: int | None = None) -> list[list["torch.Tensor"]]:
    """`tensors` in consecutive runs of one dtype of about `bucket_bytes` (`buckets`); the first run
    of about `first` bytes where the user chose no bucket size (in `chosen`)."""
    runs = buckets([t.numel() * t.element_size() for t in tensors], [t.dtype for t in tensors],
                   bucket_bytes(BUCKET_BYTES, chosen), first if chosen.bucket_bytes is None else None)
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

    def __init__(self, strategy: "TorchDistributedStrategy", variables: Sequence["keras.Variable"], options: GradientOptions,
                 name: str) -> None:
        self.strategy, self.options, self.name = strategy, options, name
        self.params = [v.value for v in variables][::-1]
        self.buckets = []  # lists of indices into params
        for run in tensor_buckets(self.params, strategy.settings, first=FIRST_BUCKET_BYTES):
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
            self.strategy.collectives.wait(*started)

    def reduce(self, grads: Sequence["torch.Tensor"]) -> list["torch.Tensor"]:
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

    def remove(self) -> None:
        """Removes the hooks, after any all-reduce still running."""
        self._wait_all()
        for hook in self.hooks:
            hook.remove()


def _check_checkpoints_of_split(callbacks: Any) -> None:
    """One line for a checkpoint in Keras's legacy HDF5 format of a model whose weights are
    split (`shard="weights"`), which reads each variable whole on the chief (not a layer
    at a time, as `.keras` and `.weights.h5` are)."""
    import keras

    for callback in callbacks or ():
        path = str(getattr(callback, "filepath", ""))
        if isinstance(callback, keras.callbacks.ModelCheckpoint) and not callback.save_weights_only and \
                path.endswith((".h5", ".hdf5")):
            raise KerasDistError(f"ModelCheckpoint({path!r}) would write the legacy HDF5 format, which reads each "
                                 "weight whole where shard='weights' splits them: name it .keras, or pass "
                                 "save_weights_only=True with .weights.h5")
