"""Horovod ring all-reduce, one process per replica, started by `horovodrun`.

Only Horovod's framework-level collectives are used (`grouped_allreduce`, `broadcast`,
`allgather`): its Keras integration does not work with Keras 3 (horovod issue 4290).
"""


import itertools
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from keras_dist import errors, keras_internals, timeouts
from keras_dist.collectives.horovod import NO_BFLOAT16, HorovodTensorFlow
from keras_dist.collectives import PEERS_SECONDS
from keras_dist.strategies.base import GradientOptions, ProcessSetup, Strategy, bucket_bytes, buckets
from keras_dist.environments import ClusterEnvironment, MPIEnvironment, threads_per_process
from keras_dist.errors import KerasDistError, PeerFailure
from keras_dist.replicas import MetricStates
from keras_dist.settings import Settings

if TYPE_CHECKING:
    import keras


logger = logging.getLogger("keras_dist")
# Horovod's Gloo timeout in seconds, for every collective and its start.
GLOO_TIMEOUT_VARIABLE = "HOROVOD_GLOO_TIMEOUT_SECONDS"
# Bytes of updated variables per broadcast from their owner under shard="optimizer": runs
# sent one after another bound what the broadcasts add to memory; runs rather than single
# variables keep the step's cost (bench/results/2026-11-27-cpu-2core-sharding-tensorflow.md).
BROADCAST_BUCKET_BYTES = 4 << 20
# How a collective's error reads when a peer stopped: Horovod's background loop saw it first
# ("Horovod has been shut down"), or the op's own Gloo wait ended first and its error (a timeout,
# a closed connection) names Gloo's transport source file.
_PEER_FAILURE_MARKS = ("Horovod has been shut down", "/gloo/transport/")


def _import_horovod():
    try:
        import horovod  # noqa: F401
    except ImportError:
        raise KerasDistError(
            "backend 'horovod' needs Horovod: run `keras-dist build-horovod` "
            "(builds it against your TensorFlow, and PyTorch, with Gloo)"
        ) from None
    try:
        import horovod.tensorflow as hvd
    except Exception as exc:  # Horovod raises ImportError or its own errors here.
        raise KerasDistError(
            f"Horovod's TensorFlow ops do not load ({exc}); rebuild them against this "
            "TensorFlow with `keras-dist build-horovod`"
        ) from None
    return hvd


class HorovodSetup(ProcessSetup):
    """What backend 'horovod' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        return MPIEnvironment.detect(environ)

    @classmethod
    def process_variables(cls, environment: ClusterEnvironment, chosen: Settings) -> dict[str, str]:
        variables, changes = chosen.variables, {}
        # N processes on one host would each start a thread pool as wide as the machine;
        # give each its share of the cores unless the user chose.
        local_size = environment.local_size
        if local_size > 1 and "TF_NUM_INTRAOP_THREADS" not in variables:
            changes["TF_NUM_INTRAOP_THREADS"] = str(threads_per_process(local_size))
        # The step timeout is, on Horovod, its Gloo timeout (read once, by hvd.init; 30 s
        # by default), unless horovodrun's own was given.
        step_timeout = timeouts.policy(chosen)
        if step_timeout.chosen and GLOO_TIMEOUT_VARIABLE not in variables:
            changes[GLOO_TIMEOUT_VARIABLE] = str(math.ceil(step_timeout.later))
        return changes

    @classmethod
    def cluster_environment(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> MPIEnvironment:
        return detected if isinstance(detected, MPIEnvironment) else MPIEnvironment.from_environ(environ)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str]:
        # One Gloo timeout for Horovod's rendezvous and every collective.
        seconds = f"{math.ceil(policy.later)} s" if policy.chosen else "Horovod's own 30 s"
        return seconds, seconds, seconds


class HorovodStrategy(Strategy):
    """Data parallelism with Horovod: gradients and metric states are all-reduced.

    Launch: `horovodrun -np 4 -H localhost:4 --gloo python train.py` (or `keras-dist
    launch --backend horovod -n 4 train.py`). Each process pins itself to the GPU of its
    local rank when GPUs are present.
    """

    name = "horovod"
    process_setup = HorovodSetup
    shares_random_seed = True
    reduces_in_keras_dist = True
    shards_optimizer_state = True

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        super().__init__(environment, chosen)
        self._hvd = _import_horovod()
        self._hvd.init()
        self.collectives = HorovodTensorFlow(self._hvd, self._peer_failure)
        from keras_dist import optimizer_sharding
        from keras_dist.fault_tolerance.checkpoint_io import CheckpointIO

        # Under shard="optimizer" a checkpoint gathers every process's share, and a backup's
        # restore hands each process its share as the chief reads it: the chief leads both.
        self.checkpoint_io = CheckpointIO(
            checkpoints_within=lambda model: optimizer_sharding.checkpoints_led_by_the_chief(model, self),
            restores_within=True)
        self._optimizer_numbers = itertools.count()
        self._metric_sums = itertools.count()  # traced in the same order on every process
        self.metric_states = MetricStates(self, sum_in_step=self._sum_metric_states_in_step)
        self._sharded_steps = False  # some optimizer's state is sharded: steps differ per process
        self._pin_gpu()
        if self._names_stopped_peers:
            try:
                self.environment.put(f"host.{self.rank}", self.environment.hostname or socket.gethostname())
            except OSError:  # the report of a stopped peer then names no host
                logger.debug("horovodrun's store took no host name", exc_info=True)
            errors.note_failures_with(lambda: self.environment.put(f"exited.{self.rank}", "1", timeout=PEERS_SECONDS))

    @property
    def _names_stopped_peers(self) -> bool:
        """Whether a failed collective can be told apart by peer: under horovodrun's Gloo, in its store."""
        return self.size > 1 and isinstance(self.environment, MPIEnvironment) and self.environment.store is not None

    def compile_arguments(self, kwargs: dict) -> dict:
        """`jit_compile=True` becomes False: Horovod's TensorFlow ops have no XLA kernel on CPUs, so
        an XLA-compiled step fails deep in TensorFlow ("No registered 'HorovodGroupedAllreduce'")."""
        kwargs = super().compile_arguments(kwargs)
        if kwargs.get("jit_compile") is True:
            logger.warning("keras_dist: Horovod's all-reduce cannot run inside XLA; the step is compiled "
                           "with jit_compile=False")
            kwargs["jit_compile"] = False
        return kwargs

    def run_loop(self, method: str, model: "keras.Model", keras_method: Callable[..., Any], arguments: dict) -> Any:
        import tensorflow as tf

        try:
            return super().run_loop(method, model, keras_method, arguments)
        except tf.errors.OpError as exc:
            failure = self._peer_failure(exc)
            if failure is None:
                raise
            raise failure from None

    def _peer_failure(self, error: Exception) -> PeerFailure | None:
        """`error`'s account where it means a peer stopped; None for any other error."""
        import tensorflow as tf

        # Horovod reports a peer that stopped answering (its Gloo timeout) or ended as its
        # own shutdown or, where the op's own Gloo wait ends first, as Gloo's error.
        if (not isinstance(error, tf.errors.OpError) or not any(mark in str(error) for mark in _PEER_FAILURE_MARKS)
                or not self._names_stopped_peers):
            return None
        return self._who_stopped()

    def _who_stopped(self) -> PeerFailure:
        """The ranks that stopped: each process that sees its collective fail notes so in
        horovodrun's store; those that have not after `PEERS_SECONDS` stopped."""
        environment = self.environment
        try:
            environment.put(f"failed.{self.rank}", "1", timeout=PEERS_SECONDS)
            time.sleep(PEERS_SECONDS)
            silent = [r for r in range(self.size) if environment.get(f"failed.{r}", timeout=PEERS_SECONDS) is None]
            hosts = [environment.get(f"host.{r}", timeout=PEERS_SECONDS) or "an unknown host" for r in silent]
            stopped = [f"rank {r} on {host}" for r, host in zip(silent, hosts)]
            # Ended by an error of its own (`errors.note_failures_with`), not frozen: no timeout to blame.
            if silent and all(environment.get(f"exited.{r}", timeout=PEERS_SECONDS) for r in silent):
                return PeerFailure(stopped, None, "run the same command again to resume from the last backup",
                                   exited=True)
        except OSError:  # the store is horovodrun's, on the launching machine
            stopped = [f"horovodrun's machine ({environment.store})"]
        timeout = self.settings.variables.get(GLOO_TIMEOUT_VARIABLE, "30")
        return PeerFailure(stopped, f"{timeout} s", f"or raise {timeouts.STEP_TIMEOUT_VARIABLE} (or horovodrun "
                           "--gloo-timeout-seconds) if a step can take that long")

    def _pin_gpu(self):
        import tensorflow as tf

        gpus = tf.config.list_physical_devices("GPU")
        if not gpus:
            return
        try:
            tf.config.set_visible_devices(gpus[self.local_rank % len(gpus)], "GPU")
            tf.config.experimental.set_memory_growth(gpus[self.local_rank % len(gpus)], True)
        except RuntimeError:
            raise KerasDistError(
                "TensorFlow was already running when keras_dist started Horovod; call "
                "keras_dist.init() (or keras_dist.compile) before building the model"
            ) from None

    @property
    def local_rank(self) -> int:
        return self._hvd.local_rank()

    def distribute_optimizer(self, optimizer: "keras.optimizers.Optimizer", options: GradientOptions) -> None:
        from keras_dist import optimizer_hooks, optimizer_sharding

        collectives = self.collectives
        if options.compression == "bf16":
            raise KerasDistError(NO_BFLOAT16)

        def allreduce_gradients(grads, name=None):
            import tensorflow as tf

            dense = [tf.convert_to_tensor(g) for g in grads][::-1]  # IndexedSlices -> dense
            # Backward yields the last layers' gradients first. One collective per bucket,
            # each depending on its own gradients only: TensorFlow's executor starts it as
            # soon as they exist, while the rest of the backward pass runs. By default
            # every gradient is a bucket, and Horovod's fusion buffer sends together those
            # ready in the same cycle (faster than fixed buckets or one collective after the
            # backward pass on a slow link: bench/results/2026-11-24-cpu-2core.md).
            runs = buckets([(g.shape.num_elements() or 0) * g.dtype.size for g in dense], [g.dtype for g in dense],
                           bucket_bytes(0, self.settings))
            reduced = []
            for k, run in enumerate(runs):
                reduced += collectives.reduce_in_step([dense[i] for i in run], mean=options.reduction == "mean",
                                                      compression=options.compression,
                                                      name=None if name is None else f"{name}.gradients.{k}")
            return reduced[::-1]

        if options.shard == "optimizer" and self.size > 1:
            if optimizer_sharding.is_sharded(optimizer):
                return
            import tensorflow as tf

            self._sharded_steps = True

            name = f"keras_dist.optimizer{next(self._optimizer_numbers)}"
            reductions_read = tf.Variable(0.0, trainable=False, name=f"{name}.reductions_read")

            def reduce_every_gradient(grads):
                # Named: the names Horovod would make up hold the path of the step's graph,
                # which differs between processes once each updates other variables.
                reduced = allreduce_gradients(grads, name)
                # Horovod's operations are stateless, and each process updates only the
                # variables it owns: TensorFlow's graph optimizer would drop the reductions of the
                # others' gradients, and the others would wait for them forever. A variable
                # written from a value of each keeps them all.
                if reduced:
                    reductions_read.assign(tf.add_n([tf.reduce_sum(tf.cast(tf.reshape(g, [-1])[:1], tf.float32))
                                                     for g in reduced]))
                return reduced

            optimizer_sharding.shard_state(
                optimizer, self, reduce_every_gradient,
                lambda variables, owners: self._broadcast_from_owners(variables, owners, name))
            return
        optimizer_hooks.reduce_gradients_before_update(optimizer, allreduce_gradients, collectives.all_in_step)

    def _broadcast_from_owners(self, variables: list, owners: list[int], name: str) -> None:
        """Each variable's value from its owner (in the train step's graph), in runs of
        consecutive variables of one owner and dtype, each closed once it reaches
        `BROADCAST_BUCKET_BYTES` (`buckets`), one run after the other: at once, TensorFlow
        would hold every run's flat copy and result, two more copies of the weights.
        Named, as Horovod matches operations across processes by name: the names
        TensorFlow makes up differ, since each process's update ran Keras's for other
        variables first; without the path of the graph they are in (steps_per_execution's
        loop), which differs for the same reason."""
        import tensorflow as tf

        assigned = []
        for root in range(self.size):
            owned = [keras_internals.variable_value(v) for v, owner in zip(variables, owners) if owner == root]
            sizes = [v.shape.num_elements() * v.dtype.size for v in owned]
            for k, run in enumerate(buckets(sizes, [v.dtype for v in owned], BROADCAST_BUCKET_BYTES)):
                group = [owned[i] for i in run]
                with tf.control_dependencies(assigned):
                    wire = self.collectives.broadcast_in_step(tf.concat([tf.reshape(v, [-1]) for v in group], 0),
                                                              root, f"{name}.{root}.{k}")
                parts = tf.split(wire, [v.shape.num_elements() for v in group])
                assigned = [v.assign(tf.reshape(part, v.shape)) for v, part in zip(group, parts)]

    def _sum_metric_states_in_step(self, tensors: Sequence[Any]) -> list[Any]:
        # Under shard="optimizer" the step's graph differs between processes (see
        # `distribute_optimizer`), and with it the names Horovod would make up: named, one
        # name per trace, as Horovod's own differ per place in the graph (with several
        # steps a call, the first step's sum and the loop's are in flight together).
        name = f"keras_dist.metric_states.{next(self._metric_sums)}" if self._sharded_steps else None
        return self.collectives.reduce_in_step(list(tensors), name=name)
