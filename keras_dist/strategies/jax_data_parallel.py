"""Keras 3 on JAX: the devices of every process form one data-parallel mesh.

Keras's own `keras.distribution.DataParallel` runs each train step as one computation
over the global batch: XLA all-reduces gradients and metric states across processes
(gloo on CPUs, NCCL on GPUs), so training logs are global without keras_dist's help.
keras_dist adds what Keras leaves to the script: each process feeds its interleaved
share of the inputs (`auto_shard_dataset=False`), only the chief writes files, and
`evaluate` and `predict` run each process's shard on its own copy of the replicated
weights (`process_local_steps`), so shards of unequal length need no padding and every
example counts once.

Keras's distribution is set only while a compiled model's `fit` runs (`on_the_mesh`), not
for the whole process: under it every variable Keras makes is a collective (JAX checks
that its value agrees on every process) and every output spans all processes, so a
model the script loads, or cuts out of the trained one to `predict`, hung or failed
("Fetching value for jax.Array that spans non-addressable devices"), and so did a save
on the chief alone (Keras makes an optimizer to list what not to save). Outside `fit`
every variable is this process's own copy, and the process is plain Keras.

Launch: `keras-dist launch --backend jax -n 2 train.py`, `horovodrun -np 2 python train.py`,
or any launcher whose cluster environment names a coordinator (torchrun-style variables,
Slurm's `srun`, or Keras's own `KERAS_DISTRIBUTION_*` variables), with `KERAS_BACKEND=jax`.
"""

import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import keras
import numpy as np

from keras_dist import (environments, keras_internals, keras_workarounds_jax, network, optimizer_hooks,
                        optimizer_sharding, split_creation, timeouts)
from keras_dist.collectives import PEERS_SECONDS
from keras_dist.collectives.jax_processes import JaxProcesses
from keras_dist.environments import ClusterEnvironment
from keras_dist.strategies.base import GradientOptions, ProcessSetup, Strategy
from keras_dist.strategies import jax_split_weights
from keras_dist.strategies.jax_peer_watch import PeerWatch, coordination_client, give_up
from keras_dist.errors import KerasDistError, PeerFailure, first_line
from keras_dist.fault_tolerance.checkpoint_io import CheckpointIO
from keras_dist.overrides import override
from keras_dist.replicas import MetricStates, Replicas
from keras_dist.settings import Settings

logger = logging.getLogger("keras_dist")

# Set by `prepare_process`: JAX's process group must start before any JAX computation.
_started = False
# The job's `PeerWatch`, once the process group started (several processes).
_peer_watch: PeerWatch | None = None


def _start_process_group(environment: ClusterEnvironment, chosen: Settings) -> None:
    """Joins this process (at `environment`'s place) to its job's JAX process group (once,
    before any JAX computation).

    `keras.distribution.initialize` also agrees on one random seed; keras_dist does that
    for every strategy in `keras_dist.startup`, without importing TensorFlow.
    """
    global _started, _peer_watch
    if _started:
        return
    import jax

    if environment.size > 1:
        coordinator = environment.server_rendezvous()
        if coordinator is None:
            raise KerasDistError(
                f"the {environment.name} launcher names no coordinator for JAX's process group; set "
                "KERAS_DISTRIBUTION_JOB_ADDRESSES=host:port (the first process's address), or launch with "
                "`keras-dist launch --backend jax`"
            )
        # CPU processes need a collectives implementation; GPUs use NCCL whatever this says.
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        host, port = coordinator.rsplit(":", 1)
        address = environment.job_address
        # The coordinator listens on the job's address only (a local cluster: loopback).
        bind = "127.0.0.1" if network.names_loopback(host.strip("[]")) else address
        if bind == address and address is not None and address != network.reaching_address(host.strip("[]")):
            # This machine is the coordinator's, and its name resolves to loopback here (Debian's
            # 127.0.1.1), where the coordinator does not listen: reach it by its address.
            coordinator = f"{address}:{port}"
        gpus = _local_gpus(chosen.variables, environment)
        step_timeout = timeouts.policy(chosen)
        start = step_timeout.first
        unjoined = (f"process {environment.rank} did not join JAX's process group at {coordinator} within {start:g} s, "
                    f"advertising {address}; check the coordinator address and set GLOO_SOCKET_IFNAME to the interface "
                    f"the other machines reach, or raise {timeouts.STEP_TIMEOUT_VARIABLE} if the processes start that far apart")
        # JAX's client aborts the process with a stack trace when its registration times
        # out (LOG(FATAL)), so keras_dist ends it first, in one line.
        watchdog = threading.Timer(start, give_up, (unjoined,))
        watchdog.daemon = True
        watchdog.start()
        later = step_timeout.later
        try:
            # JAX's heartbeats end the job too, after keras_dist's own `PeerWatch` (at twice its
            # timeout plus a margin: at equal timeouts JAX's abort, a C++ stack trace, came first).
            jax.distributed.initialize(coordinator_address=coordinator, num_processes=environment.size,
                                       process_id=environment.rank, initialization_timeout=int(start) + 5,
                                       heartbeat_timeout_seconds=2 * int(later) + PeerWatch.MARGIN_SECONDS,
                                       local_device_ids=gpus,
                                       coordinator_bind_address=None if bind is None or chosen.bind_all
                                       else f"{bind}:{port}")
        except RuntimeError as exc:
            raise KerasDistError(f"JAX's process group did not start ({str(exc).splitlines()[0]}); `import keras_dist` "
                                 "before any JAX computation, and check the coordinator address") from None
        finally:
            watchdog.cancel()
        if address is not None:
            _gloo_advertises(address)
        _peer_watch = PeerWatch(coordination_client(), environment.rank, environment.size, step_timeout)
        _peer_watch.start()
    _started = True


def _local_gpus(environ: Mapping[str, str], environment: ClusterEnvironment) -> list[int] | None:
    """The GPUs this process takes among its machine's (`jax.distributed.initialize`'s
    `local_device_ids`); None where JAX runs on CPUs or the process is alone on its machine.

    JAX gives each process every GPU it sees, and NCCL refuses two processes on one GPU
    (canary: tests/gpu/test_gpu.py::test_nccl_refuses_two_processes_on_one_gpu), so the
    processes on one machine split its GPUs.
    """
    platforms = environ.get("JAX_PLATFORMS", "")
    if environment.local_size == 1 or (platforms and "cuda" not in platforms and "gpu" not in platforms):
        return None
    if not environments.jax_cuda_plugin_installed():
        return None
    gpus = environments.visible_gpus(environ)
    if gpus == 0:
        return None
    if environment.local_size > gpus:
        raise KerasDistError(
            f"{environment.local_size} JAX processes share {gpus} GPU{'s' if gpus > 1 else ''} on "
            f"{socket.gethostname()}, and NCCL needs a GPU of its own for each; start at most {gpus} per machine "
            f"(one process drives all of a machine's GPUs: `keras-dist launch --backend jax -n {gpus}`), "
            "or set JAX_PLATFORMS=cpu")
    each = gpus // environment.local_size
    return list(range(environment.local_rank * each, (environment.local_rank + 1) * each))


def _gloo_advertises(address):
    """Makes JAX's gloo collectives advertise `address`, not what the host name resolves to.

    JAX builds them with `make_gloo_tcp_collectives(distributed_client)` alone
    (jax/_src/xla_bridge.py, `make_cpu_client`), so gloo falls back to the host name,
    which Debian maps to 127.0.1.1, and no variable changes that. The function takes a
    `hostname`; the CPU backend is registered again, before its first use, with it.
    """
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    def cpu_backend():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=coordination_client(),
                                                     hostname=address)
        return xla_bridge.make_cpu_client(collectives=collectives)

    try:
        xla_bridge.register_backend_factory("cpu", cpu_backend, priority=0, fail_quietly=False)
    except RuntimeError:  # the script used JAX before `import keras_dist`: gloo keeps its own choice
        logger.warning("JAX's CPU backend started before keras_dist; gloo advertises the address of the host name")


# How gloo says that the process at the other end of a connection ended.
_PEER_CLOSED = ("Connection closed by peer", "Connection reset by peer")


class _JaxMetricStates(MetricStates):
    """On the mesh, a step is one computation over every process: its metric states are
    one global array, read and set as they are; in `process_local_steps` each process holds
    its own share, as by default.

    Args:
        on_the_mesh: whether steps run over every process now.
    """

    def __init__(self, replicas: Replicas, on_the_mesh: Callable[[], bool]):
        super().__init__(replicas)
        self._on_the_mesh = on_the_mesh

    def global_values(self, variables: Sequence[keras.Variable]) -> list:
        if self._on_the_mesh():
            return [keras.ops.convert_to_numpy(v.value) for v in variables]
        return super().global_values(variables)

    def assign_global(self, variables: Sequence[keras.Variable], global_states: Sequence[np.ndarray]) -> None:
        if not self._on_the_mesh():
            super().assign_global(variables, global_states)
            return
        for variable, value in zip(variables, global_states):
            variable.assign(value)


class JaxSetup(ProcessSetup):
    """What backend 'jax' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        # A process a platform started alone on a host with several accelerators (a Cloud
        # TPU VM's chips, a GPU machine) trains on all of them, as `mirrored` does on TensorFlow.
        return detected.size > 1 or (detected.name == "local" and environments.jax_local_devices(environ) > 1)

    @classmethod
    def prepare_process(cls, environment: ClusterEnvironment, chosen: Settings) -> None:
        _start_process_group(environment, chosen)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str]:
        # `PeerWatch` ends the job when a process stops beating (beats run on threads of their
        # own, so a long first step does not stop them), and when every process waited in a
        # step or host collective `first` s, or `later` s once the job is stalled (`PeerWatch._late`).
        stalled = "" if policy.first == policy.later else f", {policy.later:g} s once stalled"
        waits = f"{policy.later:g} s without a beat; {policy.first:g} s with every process waiting{stalled}"
        return f"{policy.first:g} s", waits, waits


class JaxDataParallelStrategy(Strategy):
    """Synchronous data parallelism on Keras's JAX backend, over every process's devices."""

    name = "jax"
    process_setup = JaxSetup
    shares_random_seed = True
    shards_optimizer_state = True
    shards_weights = True

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        super().__init__(environment, chosen)
        if keras.backend.backend() != "jax":
            raise KerasDistError(f"backend 'jax' needs Keras on JAX, but Keras runs on {keras.backend.backend()!r}; "
                                 "set KERAS_BACKEND=jax before Python starts")
        import jax

        _start_process_group(self.environment, self.settings)
        self._jax = jax
        self.collectives = JaxProcesses(jax, _in_collective)
        self.distribution = keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False)
        self._local_depth = 0
        self._gathers = 0  # `_whole_values` calls so far, which every process counts alike
        # The trainable weights split over the mesh in the fit under way (shard="weights"), by id.
        self._split_weights: dict[int, keras.distribution.TensorLayout] = {}
        # How the saves of each model whose state is split over the processes (a sharded
        # optimizer's; a model built in `keras_dist.split_weights`) are walked, by id.
        self._leads: dict[int, jax_split_weights.ModelLeads] = {}
        self.metric_states = _JaxMetricStates(self, on_the_mesh=lambda: self._local_depth == 0)
        # The chief saves and restores alone, so process-locally; a model split for good a
        # layer at a time, the chief leading and the others following.
        self.checkpoint_io = CheckpointIO(whole_weights=self._saving, split_weight_ids=self._split_weight_ids,
                                          saves_within=self._saving,
                                          restores_within=True, saves_by_layer=jax_split_weights.split_for_good,
                                          checkpoints_within=self._checkpointing)

    @property
    def num_replicas(self) -> int:
        return self._jax.device_count()

    def prepare_model(self, model: keras.Model) -> keras.Model:
        keras_workarounds_jax.metric_resets_keep_their_layout(model, _replicate)
        make_train_function = model.make_train_function

        def make_train_function_on_the_mesh(force: bool = False) -> None:
            # Keras reads each variable's placement here for the step's output; variables
            # `fit` made before (building an unbuilt model, its optimizer's and metrics')
            # were made on one device, where `on_the_mesh` could not see them yet.
            if keras.distribution.distribution() is self.distribution:
                _replicate(_variables_of(model), self._split_weights)
            make_train_function(force)
            if _peer_watch is not None:
                model.train_function = _peer_watch.timed_steps(model.train_function, model.steps_per_execution)

        override(model, "make_train_function", make_train_function_on_the_mesh)
        return model

    def run_loop(self, method: str, model: keras.Model, keras_method: Callable[..., Any], arguments: dict) -> Any:
        try:
            if method != "fit":
                return keras_method(**arguments)
            with self.on_the_mesh(model):
                return keras_method(**arguments)
        except (ValueError, RuntimeError) as exc:  # jaxlib's errors for a failed gloo collective
            if "Gloo" not in str(exc) or not any(closed in str(exc) for closed in _PEER_CLOSED):
                raise
            raise self._who_exited(exc) from None

    @contextlib.contextmanager
    def on_the_mesh(self, model: keras.Model) -> Iterator[None]:
        """Keras's distribution set, and the model's variables replicated over the global mesh
        (from this process's copy, with no collective), while `fit` runs; afterwards each
        variable is this process's copy again, and Keras's distribution the one before."""
        if self.num_replicas == 1 or keras.distribution.distribution() is self.distribution:
            yield
            return
        idle = keras.distribution.distribution()  # `compiled_elsewhere.CompiledElsewhereWatch`, or none
        keras.distribution.set_distribution(self.distribution)
        try:
            _replicate(_variables_of(model))
            yield
        finally:
            keras.distribution.set_distribution(idle)
            _localize(_variables_of(model), self._split_weights)
            self._split_weights.clear()

    def _who_exited(self, error: Exception) -> PeerFailure:
        """A peer closed its connections: it ended (a frozen one times out instead, `PeerWatch`).
        Rank 0 serves JAX's coordination service, whose port then refuses connections, though
        perhaps only after its gloo connections closed."""
        from jax._src import distributed

        coordinator = distributed.global_state.coordinator_address  # as joined, after `_start_process_group`
        gone = ([f"rank 0 (JAX's coordinator at {coordinator})"] if coordinator and self.rank != 0
                and network.refuses(coordinator, PEERS_SECONDS, within=PEERS_SECONDS) else [])
        return PeerFailure(gone, None, "run the same command again to resume from the last backup",
                           cause=first_line(error), exited=True)

    def distribute_optimizer(self, optimizer: keras.optimizers.Optimizer, options: GradientOptions) -> None:
        # The sharded train step averages gradients itself (XLA's all-reduce).
        if options.compression is not None or options.reduction != "mean":
            raise KerasDistError("backend 'jax' averages gradients inside XLA's step; drop gradient_compression "
                                 "and gradient_reduction from keras_dist.compile")
        if options.shard is not None:
            # Each slot is split over the mesh; XLA's step then updates each device's part and
            # gathers the updated variables. The slots stay split outside fit (`_localize`).
            optimizer_sharding.shard_state_by_layout(optimizer, self.is_chief, self._split_layout, self._whole_values,
                                                     _place, options.shard, self._hand_out_loaded)

    def after_initial_sync(self, model: keras.Model) -> None:
        """Under shard="weights", splits the model's trainable weights over the mesh, once every
        process holds the same (a backup the chief restored included), and compiles the step
        again: its outputs keep the split, and XLA gathers each weight where the step uses it."""
        state = optimizer_sharding.sharded_state(model.optimizer) if model.optimizer is not None else None
        if state is None or state.level != "weights" or keras.distribution.distribution() is not self.distribution:
            return
        if split_creation.built_split(model):  # split for good already; what was built outside the block stays
            return
        for variable in model.trainable_variables:
            layout = self._split_layout(tuple(variable.shape))
            if layout is not None:
                self._split_weights[id(variable)] = layout
        _replicate(_variables_of(model), self._split_weights)
        model.make_train_function(force=True)

    def _whole_values(self, variables: Sequence[keras.Variable]) -> Iterator[np.ndarray]:
        """Each variable's whole value in turn, on every process (collective: first every
        process arrives, or the ones that did not are named); in a save a model split for
        good leads, announced to the others, and in a stand-in's own walk, empty values."""
        saving = next((lead for lead in self._live_leads() if lead.leading or lead.standing_in), None)
        if saving is not None and not saving.announce_state(variables):
            for variable in variables:
                yield np.zeros((0,), keras.backend.standardize_dtype(variable.dtype))
            return
        self._gathers += 1
        if _peer_watch is not None:
            _peer_watch.all_arrive(f"gather/{self._gathers}")
        for variable in variables:
            yield _whole_value(variable)

    def _hand_out_loaded(self, variables: Sequence[keras.Variable], position: int, whole: np.ndarray) -> bool:
        """In a backup's restore, the chief's alone: hands the whole value it read for the
        optimizer variable at `position` to the others (`ModelLeads.hand_out_loaded_state`);
        False outside one (a load every process makes)."""
        lead = next((lead for lead in self._live_leads() if lead.leading), None)
        if lead is None:
            return False
        # In the variable's dtype, which the others expect (a file written elsewhere may differ).
        whole = np.asarray(whole, dtype=keras.backend.standardize_dtype(variables[position].dtype))
        lead.hand_out_loaded_state(list(variables), position, whole)
        return True

    def _split_layout(self, shape: tuple) -> keras.distribution.TensorLayout | None:
        """A layout splitting an array of `shape` over every device, along its first axis that
        divides evenly; None where none does (a scalar, a bias of odd length)."""
        mesh = self.distribution.device_mesh
        devices = self.num_replicas
        for axis, length in enumerate(shape):
            if length and length % devices == 0:
                spec = [None] * len(shape)
                spec[axis] = mesh.axis_names[0]
                return keras.distribution.TensorLayout(spec, mesh)
        return None

    # --- weights split from their creation (`keras_dist.split_weights`) -----------------
    def creating_split_weights(self) -> contextlib.AbstractContextManager[None]:
        if self.size == 1:
            return contextlib.nullcontext()
        return jax_split_weights.built_split(self._split_layout, _place)

    def _live_leads(self) -> list[jax_split_weights.ModelLeads]:
        """The leads of models still alive; those of models gone go (a lead holds its model
        weakly, and a model split for good's lead its parts)."""
        self._leads = {key: lead for key, lead in self._leads.items() if lead.model is not None}
        return list(self._leads.values())

    def after_compile(self, model: keras.Model) -> None:
        self._live_leads()
        self._leads.pop(id(model), None)  # compiled again
        if self.size == 1:
            return
        if split_creation.built_split(model):
            self._leads[id(model)] = jax_split_weights.SplitForGood(model, self.collectives, _whole_value, _place)
        elif any(optimizer_sharding.is_sharded(o) for o in optimizer_hooks.optimizers_of(model)):
            self._leads[id(model)] = jax_split_weights.ModelLeads(model, self.collectives, _place)

    def _lead_of(self, model: keras.Model) -> jax_split_weights.ModelLeads | None:
        lead = self._leads.get(id(model))
        return lead if lead is not None and lead.model is model else None

    def _split_for_good(self, model: keras.Model) -> jax_split_weights.SplitForGood | None:
        lead = self._lead_of(model)
        return lead if isinstance(lead, jax_split_weights.SplitForGood) else None

    def _split_weight_ids(self) -> set[int]:
        return {*self._split_weights, *(id(v) for lead in self._live_leads()
                                        if isinstance(lead, jax_split_weights.SplitForGood) for v in lead.variables)}

    def _saving(self, model: keras.Model) -> contextlib.AbstractContextManager[None]:
        # The weights of a model split for good stay split: its layers gather as Keras writes them,
        # in a save the chief leads (`export`, or a save on the chief alone, would hold it whole).
        split = self._split_for_good(model)
        if split is not None and not (split.leading or split.standing_in):
            raise KerasDistError(split_creation.NOT_SAVED_WHOLE)
        return self.process_local_steps(model, whole=False)

    @contextlib.contextmanager
    def _checkpointing(self, model: keras.Model) -> Iterator[None]:
        lead = self._lead_of(model)
        with lead.checkpoint_together() if lead is not None else contextlib.nullcontext(), self._saving(model):
            yield

    # --- work one process does alone --------------------------------------------------
    @contextlib.contextmanager
    def process_local_steps(self, model: keras.Model, whole: bool = True) -> Iterator[None]:
        """Runs Keras on this process's devices alone: `evaluate`, `predict`, the chief's saves
        (without `whole`, where the weights of a model split for good stay split).

        Inside `fit` (`on_the_mesh`), every step, and even every assignment to a variable
        (JAX checks the value is the same everywhere), is a collective. Here the model's
        variables become copies on this process's first device and Keras's distribution
        is unset, so each process steps through its own shard, however long (keras_dist
        sums the metric states at the end), and the chief alone can save or restore a
        checkpoint. On exit inside `fit` every variable is replicated again from this
        process's value, without a collective (the chief's restored weights then reach
        the others through keras_dist's broadcast).
        """
        if self.num_replicas == 1 or self._local_depth:
            yield
            return
        _localize(_variables_of(model), self._split_weights)
        global_functions = (model.test_function, model.predict_function)
        model.test_function, model.predict_function = getattr(model, "_keras_dist_local_functions", (None, None))
        in_fit = keras.distribution.distribution()
        keras.distribution.set_distribution(None)
        self._local_depth += 1
        split = self._split_for_good(model) if whole else None
        try:
            with split.whole() if split is not None else contextlib.nullcontext():
                yield
        finally:
            self._local_depth -= 1
            keras.distribution.set_distribution(in_fit)
            override(model, "_keras_dist_local_functions", (model.test_function, model.predict_function))
            model.test_function, model.predict_function = global_functions
            if in_fit is self.distribution:
                # Those made meanwhile too (a model built by evaluate).
                _replicate(_variables_of(model), self._split_weights)

    def describe(self) -> dict:
        return {**super().describe(), "devices": [str(d) for d in self._jax.devices()]}


def _replicate(variables, split=None):
    """Places each variable not yet on the distribution's layout there, from this process's value
    (or, for those in `split`, by id, on that layout: split over the mesh).

    Built from this process's own copy on each of its devices, with no collective: JAX's
    `device_put` would check with every process that the values agree. Variables that
    differ (weights initialized without a seed) are made equal by keras_dist's broadcast
    of the chief's state before they are used.
    """
    import jax

    for variable in variables:
        if split and id(variable) in split:
            keras_internals.set_jax_layout(variable, split[id(variable)])
        sharding = keras_internals.jax_sharding(variable)
        if sharding is None:
            continue  # no distribution
        value = keras_internals.variable_value(variable)
        if getattr(value, "sharding", None) == sharding:
            continue
        _place(variable, value.addressable_data(0) if isinstance(value, jax.Array) else value)


def _place(variable, whole):
    """Sets `variable` to `whole` on its layout's devices, each of this process's devices
    taking its part of `whole` (the same value on every process), with no collective."""
    import jax

    sharding = keras_internals.jax_sharding(variable)
    if sharding is None:  # no layout and no distribution: this process's own copy
        variable.assign(whole)
        return
    parts = sharding.addressable_devices_indices_map(tuple(variable.shape))
    # A copy of each part smaller than the whole: on CPUs `device_put` can keep a NumPy
    # array's own buffer, and a slice's is the whole array's.
    keras_internals.set_jax_value(variable, jax.make_array_from_single_device_arrays(
        tuple(variable.shape), sharding, [jax.device_put(_own_part(whole, index), device)
                                          for device, index in parts.items()]))


def _own_part(whole, index):
    part = whole[index]
    return np.array(part) if isinstance(part, np.ndarray) and part.size < np.size(whole) else part


def _in_collective() -> contextlib.AbstractContextManager:
    """Where a host collective runs: timed by the job's `PeerWatch`, where there is one."""
    return _peer_watch.in_collective() if _peer_watch is not None else contextlib.nullcontext()


def _whole_value(variable) -> np.ndarray:
    """A variable's whole value, gathered from every process where it is split over them
    (collective then: every process calls it for the same variables)."""
    from jax.experimental import multihost_utils

    value = keras_internals.variable_value(variable)
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    with _in_collective():
        return np.asarray(multihost_utils.process_allgather(value, tiled=True))


def _localize(variables, split=None):
    """Makes each variable this process's own copy, on its first device, with no layout; those in
    `split` (by id) are gathered whole (collective: every process calls it alike)."""
    import jax

    for variable in variables:
        value = keras_internals.variable_value(variable)
        if not isinstance(value, jax.Array):
            continue  # not made yet
        if split and id(variable) in split:
            keras_internals.set_jax_value(variable, jax.numpy.array(_whole_value(variable)))
            keras_internals.drop_jax_layout(variable)
            continue
        if not value.sharding.is_fully_replicated:
            continue  # a sharded optimizer's slot, which stays split (`shard_state_by_layout`)
        # A copy: Keras's step donates its state, and this process's shard of the global
        # array shares its buffer. Through NumPy, so it is uncommitted like the metric
        # states Keras resets and the batches it feeds: committed weights beside them
        # compiled every local step twice, at each evaluation.
        local = np.asarray(value.addressable_data(0))
        keras_internals.set_jax_value(variable, jax.numpy.array(local))
        keras_internals.drop_jax_layout(variable)


def _variables_of(model):
    """The model's, its metrics' and its optimizers' variables (what Keras's steps read; a
    GAN's `compile` takes optimizers of its own)."""
    optimizer_variables = [v for optimizer in optimizer_hooks.optimizers_of(model) for v in optimizer.variables]
    return list({id(v): v for v in [*model.variables, *model.metrics_variables, *optimizer_variables]}.values())
