"""The parameter-server strategy, as the chief runs it (`keras_dist.init` on the chief)."""

import contextlib
import sys
import threading
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import keras
import tensorflow as tf

from keras_dist import keras_workarounds, network, optimizer_hooks, timeouts
from keras_dist.environments import ClusterEnvironment, TFConfigEnvironment, detected_cluster
from keras_dist.errors import KerasDistError, PeerFailure, first_line
from keras_dist.launchers import binding
from keras_dist.replicas import InputPlan
from keras_dist.settings import Settings
from keras_dist.strategies import tf_server
from keras_dist.strategies.base import GradientOptions, ProcessSetup, Strategy
from keras_dist.strategies.parameter_server.loop import CoordinatedSteps
from keras_dist.strategies.parameter_server.server import SERVING_TASKS, announce_end, ps_cluster, serve
from keras_dist.strategies.tf_strategy import adopt_optimizer, move_variables

class ParameterServerSetup(ProcessSetup):
    """What backend 'parameter_server' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        return bool((detected_cluster(environ) or {}).get("ps"))

    @classmethod
    def process_variables(cls, environment: ClusterEnvironment, chosen: Settings) -> dict[str, str]:
        ps_cluster(chosen.variables)  # its one-line errors first
        changes = tf_server.server_variables(chosen.variables, chosen)
        if "GRPC_FAIL_FAST" not in chosen.variables:
            # The coordinator retries a step on another worker only if RPCs fail fast.
            changes["GRPC_FAIL_FAST"] = "use_caller"
        return changes

    @classmethod
    def prepare_process(cls, environment: ClusterEnvironment, chosen: Settings) -> None:
        binding.restart_with_binding()
        cluster, kind, index = ps_cluster(chosen.variables)  # as `process_variables` may have rewritten TF_CONFIG
        if kind in SERVING_TASKS:
            sys.exit(serve(cluster, kind, index))
        # Connecting moves this process's devices into the cluster and invalidates variables
        # made before; connect now, so models the script builds before compile stay valid.
        tf.config.experimental_connect_to_cluster(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                                                  job_name="chief")

    @classmethod
    def cluster_environment(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> TFConfigEnvironment:
        ps_cluster(environ)  # its one-line errors first
        return detected if isinstance(detected, TFConfigEnvironment) else TFConfigEnvironment.from_environ(environ)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str]:
        # Joining is TensorFlow's: its servers wait for the cluster's tasks without a bound of ours.
        return "TensorFlow's own", f"{policy.first:g} s", f"{policy.later:g} s"


class ParameterServerStrategy(Strategy):
    """Asynchronous training with variables on parameter servers.

    Selected when TF_CONFIG lists `ps` tasks. Launch with
    `keras-dist launch --backend parameter_server -n WORKERS --ps K train.py`, or set
    TF_CONFIG on each task of a cluster with one `chief`, `worker` and `ps` tasks. The
    chief runs the script; workers and ps tasks serve from `import keras_dist` on.

    Inputs: NumPy arrays and finite `tf.data` datasets are read by the chief and each
    batch is trained exactly once per epoch by whichever worker is free; an endless
    dataset with `steps_per_epoch`, and a dataset function
    (`fn(input_context) -> tf.data.Dataset`, which needs `steps_per_epoch`), are built
    on every worker instead, which then reads and preprocesses its own copy.
    `evaluate` and `predict` count every example exactly once,
    even when a worker is lost mid-way.

    Variables are placed whole, round-robin over the ps tasks, unless a partitioner
    splits large ones (embedding tables) into shards on several ps tasks. A sharded
    `Embedding` then reads and updates only the rows of each batch. Sharded variables
    need Keras's own `train_step` and an optimizer without `weight_decay` or `use_ema`.

    Args:
        variable_partitioner: a `tf.distribute.experimental.partitioners` partitioner;
            default: with `KERAS_DIST_MIN_SHARD_BYTES=N` set,
            `MinSizePartitioner(min_shard_bytes=N, max_shards=<number of ps tasks>)`,
            else none.
        step_timeout: seconds a step may run before the job stops with a one-line
            error (a frozen worker would otherwise stall it silently); default
            `KERAS_DIST_STEP_TIMEOUT`, else 120 for the first steps (they trace the
            step function) and 30 once each worker has run it.

    Example:

    ```python
    ctx = keras_dist.init()  # on the chief; worker and ps tasks never get here
    print(ctx.name, ctx.num_replicas)  # parameter_server, the number of workers
    # Tables of 1 MiB and more split over up to 4 ps tasks, in shards of 1 MiB or more:
    keras_dist.init(variable_partitioner=tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=1 << 20, max_shards=4))
    ```
    """

    name = "parameter_server"
    process_setup = ParameterServerSetup
    runs_keras_loops = False

    def __init__(self, environment: TFConfigEnvironment, chosen: Settings | None = None, variable_partitioner: Any = None,
                 step_timeout: float | None = None):
        super().__init__(environment, chosen)
        cluster, kind = self.environment.cluster, self.environment.task_type
        self.step_timeout = timeouts.policy(self.settings, step_timeout)
        if kind != "chief":
            raise KerasDistError(f"TF_CONFIG task {kind!r} serves under backend 'parameter_server'; "
                                 "only the 'chief' task runs the script past `import keras_dist`")
        self.cluster = cluster
        self.num_workers = len(cluster["worker"])
        self.variable_partitioner = variable_partitioner or _partitioner_from_settings(len(cluster["ps"]), self.settings)
        self.strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                                                              variable_partitioner=self.variable_partitioner)
        if self.strategy.num_replicas_in_sync > 1:
            # Each closure trains one batch the chief read; splitting it over a worker's GPUs is not done.
            raise KerasDistError("backend 'parameter_server' runs one replica per worker; give each worker task one "
                                 "GPU (CUDA_VISIBLE_DEVICES) and start more worker tasks")
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self.stalled = threading.Event()  # set by a step that did not finish in time
        announce_end(cluster, self.stalled)
        self._steps = weakref.WeakKeyDictionary()  # model -> CoordinatedSteps of its latest compile

    @property
    def num_replicas(self) -> int:
        return self.num_workers

    @property
    def input_plan(self) -> InputPlan:
        # The chief reads batches of the script's size; each runs on one worker.
        return InputPlan(num_shards=self.size, shard_index=self.rank)

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return self.strategy.scope()

    def prepare_model(self, model: keras.Model) -> keras.Model:
        move_variables(model, self.strategy)
        keras_workarounds.sharded_variables_savable(model.variables)  # saving before fit too
        self._steps.pop(model, None)  # a recompiled model gets new step functions
        return model

    def distribute_optimizer(self, optimizer: keras.optimizers.Optimizer, options: GradientOptions) -> None:
        if options.reduction != "mean" or options.compression:
            raise KerasDistError("backend 'parameter_server' applies each worker's gradients as they come; "
                                 "drop gradient_reduction and gradient_compression")
        # These assign variables inside `tf.cond` branches, which the stateless step
        # (see CoordinatedSteps) cannot hand back to the ps tasks.
        for option in ("gradient_accumulation_steps", "ema_overwrite_frequency"):
            if getattr(optimizer, option, None):
                raise KerasDistError(f"backend 'parameter_server' does not support the optimizer's {option}; drop it")
        if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
            raise KerasDistError("backend 'parameter_server' does not support LossScaleOptimizer (mixed_float16); "
                                 "use float32 or mixed_bfloat16")
        adopt_optimizer(optimizer, self.strategy)
        if self.variable_partitioner is not None:
            keras_workarounds.sharded_variable_updates(optimizer)

    def describe(self) -> dict:
        partitioner = self.variable_partitioner
        return {**super().describe(), "workers": self.num_workers, "strategy": "ParameterServerStrategy",
                "variable_partitioner": type(partitioner).__name__ if partitioner else None}

    def run_loop(self, method: str, model: keras.Model, keras_method: Callable[..., Any], arguments: dict) -> Any:
        if model.run_eagerly:
            raise KerasDistError("backend 'parameter_server' runs steps on workers as tf.functions; drop "
                                 "run_eagerly=True (debug eagerly with KERAS_DIST_BACKEND=single)")
        unbuilt = [o for o in optimizer_hooks.optimizers_of(model) if o is not model.optimizer and not o.built]
        if unbuilt and method == "fit":
            # It would build inside a step, where variables cannot be created on the ps tasks.
            raise KerasDistError(f"backend 'parameter_server' needs every optimizer the model holds built before fit; "
                                 f"call build(variables) on the {type(unbuilt[0]).__name__} optimizer your compile "
                                 "takes, with the variables it updates")
        steps = self._steps.get(model)
        if steps is None:
            steps = self._steps[model] = CoordinatedSteps(model, self.strategy, self.coordinator, self.cluster["worker"],
                                                         self.step_timeout, self.stalled)
        try:
            return getattr(steps, method)(**arguments)
        except tf.errors.OpError as exc:
            # A lost ps shows as whatever its last reads broke: often Unavailable, at
            # times the end of a worker's input (seen: OutOfRange after a ps was killed).
            lost = [f"/job:ps/task:{i} ({address})" for i, address in enumerate(self.cluster["ps"])
                    if not network.answers(address)]
            if lost:
                raise PeerFailure(lost, None, _RESTART, cause=first_line(exc)) from None
            if isinstance(exc, (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError)):
                raise KerasDistError(f"a parameter server or the cluster became unreachable ({first_line(exc)}); "
                                     f"{_RESTART}") from None
            raise


def _partitioner_from_settings(num_ps: int, chosen: Settings) -> Any:
    min_shard_bytes = chosen.min_shard_bytes
    if min_shard_bytes is None:
        return None
    return tf.distribute.experimental.partitioners.MinSizePartitioner(min_shard_bytes=min_shard_bytes, max_shards=num_ps)


_RESTART = "restart the job: the chief resumes from its last BackupAndRestore checkpoint"

