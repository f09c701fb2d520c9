"""`tf.distribute.MultiWorkerMirroredStrategy`: one process per machine, set up by TF_CONFIG.

keras_dist splits the inputs by worker (interleaved, as for every backend); the strategy
gets each worker's shard as it is, with TF's own auto-sharding off, and hands each local
replica its own batches.
"""

import atexit
import dataclasses
import functools
import logging
import os
import re
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from keras_dist import keras_workarounds, timeouts
from keras_dist.collectives.tf_distribute import TFDistribute
from keras_dist.replicas import InputPlan
from keras_dist.strategies.base import ProcessSetup, bucket_bytes
from keras_dist.strategies.tf_strategy import TFDistributeStrategy
from keras_dist.fault_tolerance.checkpoint_io import CheckpointIO
from keras_dist.environments import ClusterEnvironment, TFConfigEnvironment, detected_cluster, threads_per_process
from keras_dist.errors import KerasDistError, PeerFailure
from keras_dist.launchers import binding
from keras_dist.overrides import override
from keras_dist.settings import Settings
from keras_dist.strategies import tf_server

logger = logging.getLogger("keras_dist")

if TYPE_CHECKING:
    import keras
    import tensorflow as tf


# Gradient bytes per all-reduce (TensorFlow's CommunicationOptions.bytes_per_pack; 0: one
# for all): the fastest of those measured between two hosts on a slow link
# (bench/results/2026-11-25-cpu-2core-hosts.md).
PACK_BYTES = 2**18
# Created by `prepare_process`: collective ops must be configured at program start-up.
_strategy = None
# How TensorFlow's coordination service names a task that stopped sending heartbeats.
_UNHEALTHY = re.compile(r"unhealthy.*?/job:(\w+)/replica:\d+/task:(\d+)", re.S)


class MultiWorkerMirroredSetup(ProcessSetup):
    """What backend 'multi_worker_mirrored' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        cluster = detected_cluster(environ)  # {} when unreadable: this backend reports what is wrong
        return cluster is not None and not cluster.get("ps")

    @classmethod
    def process_variables(cls, environment: ClusterEnvironment, chosen: Settings) -> dict[str, str]:
        changes = {}
        local_size = environment.local_size
        if local_size > 1 and "TF_NUM_INTRAOP_THREADS" not in chosen.variables:
            # Workers sharing this machine would each size a thread pool for all of it.
            changes["TF_NUM_INTRAOP_THREADS"] = str(threads_per_process(local_size))
        if _strategy is None:
            changes.update(tf_server.server_variables(chosen.variables, chosen))
        return changes

    @classmethod
    def prepare_process(cls, environment: ClusterEnvironment, chosen: Settings) -> None:
        global _strategy
        if _strategy is None:
            binding.restart_with_binding()
            _strategy = _make_strategy(chosen, environment)

    @classmethod
    def cluster_environment(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> TFConfigEnvironment:
        return detected if isinstance(detected, TFConfigEnvironment) else TFConfigEnvironment.from_environ(environ)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str]:
        # Collectives are not timed (a timeout costs TensorFlow a thread per collective): the
        # coordination service ends the job when a worker's heartbeats, sent from a thread of
        # their own, stop for the later steps' timeout.
        beats = f"{policy.later:g} s without a heartbeat"
        return "TensorFlow's own", beats, beats


class MultiWorkerMirroredStrategy(TFDistributeStrategy):
    """Synchronous data parallelism across machines with collective all-reduce.

    Selected when TF_CONFIG describes a cluster without parameter servers. Launch with
    `keras-dist launch --backend multi_worker_mirrored -n 2 train.py`, or set TF_CONFIG
    on each machine. The chief is the `chief` task, else worker 0. Import keras_dist
    before building any model: the strategy must start before TensorFlow does.
    """

    name = "multi_worker_mirrored"
    process_setup = MultiWorkerMirroredSetup
    shares_random_seed = True
    keras_workarounds = (keras_workarounds.build_from_local_batch,
                         functools.partial(keras_workarounds.step_functions, scalar_logs=True, skip_empty_batches=True))

    def __init__(self, environment: TFConfigEnvironment, chosen: Settings | None = None):
        if environment.rank >= environment.size:
            raise KerasDistError(f"TF_CONFIG task {environment.task_type!r} does not train under backend "
                                 "'multi_worker_mirrored'; run it as a 'worker'")
        super().__init__(environment, chosen)
        self.collectives = TFDistribute(self.strategy, environment.rank, environment.size)
        # Saving is a collective too: the other workers save into scratch directories.
        self.checkpoint_io = CheckpointIO(workers_save_in_scratch=True)

    def make_strategy(self) -> "tf.distribute.Strategy":
        return _strategy if _strategy is not None else _make_strategy(self.settings, self.environment)

    def prepare_model(self, model: "keras.Model") -> "keras.Model":
        from keras_dist.callbacks.sync_state import check_same_variables

        # Moving variables under the strategy broadcasts them: check the models match first.
        check_same_variables(model.weights, self)
        model = super().prepare_model(model)
        predict_locally(model, self.strategy)
        return model

    def run_loop(self, method: str, model: "keras.Model", keras_method: Callable[..., Any], arguments: dict) -> Any:
        import tensorflow as tf

        try:
            return super().run_loop(method, model, keras_method, arguments)
        except (tf.errors.UnavailableError, tf.errors.DeadlineExceededError) as exc:
            stopped = _stopped_task(str(exc), self.environment.cluster)
            if stopped is None:
                raise
            # TensorFlow's teardown would wait for the lost task, 10 s at a time ("restart
            # your program to reset", its error says): the process ends without it.
            atexit.register(_end_now)
            raise PeerFailure([stopped], "TensorFlow's heartbeat timeout", "restart the job (BackupAndRestore "
                              "resumes where the last backup left off)") from None

    @property
    def input_plan(self) -> InputPlan:
        # Every step is a collective: uneven evaluation shards must still end together.
        return dataclasses.replace(super().input_plan, collective_steps=True,
                                   marks_equal_steps=True)


def _stopped_task(error: str, cluster: dict) -> str | None:
    """"rank R on HOST (/job:KIND/task:I)" for the task TensorFlow's coordination service lost, from its error.

    The service (on the chief) names a task that missed its heartbeats; a task whose own
    heartbeats to the service time out has lost the chief.
    """
    found = _UNHEALTHY.search(error)
    trainers = [(kind, i) for kind in TFConfigEnvironment.TRAINERS for i in range(len(cluster.get(kind, [])))]
    if found is not None:
        task = found.group(1), int(found.group(2))
    elif "CoordinationService/Heartbeat" in error and trainers:
        task = trainers[0]
    else:
        return None
    kind, index = task
    rank = f"rank {trainers.index(task)}" if task in trainers else kind
    return f"{rank} on {cluster[kind][index].rsplit(':', 1)[0]} (/job:{kind}/task:{index})"


def _end_now() -> None:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def predict_locally(model: "keras.Model", strategy: "tf.distribute.Strategy") -> None:
    """Makes `model.predict` return this worker's outputs only, in input order.

    Keras all-gathers predictions across workers at every step, which suits TF's own
    sharding; keras_dist already gathers the interleaved shards once, at the end.

    Args:
        model: the model; its `make_predict_function` is replaced on this instance only.
        strategy: the model's MultiWorkerMirroredStrategy.
    """
    import tensorflow as tf
    from keras import tree

    from keras_dist.keras_internals import concat

    @tf.function(reduce_retracing=True)
    def one_step(data):
        outputs = strategy.run(model.predict_step, args=(data,))
        # Local replicas hold consecutive slices of this worker's batch.
        return tree.map_structure(lambda v: concat(strategy.experimental_local_results(v)), outputs)

    def predict_function(batches):  # Keras passes `steps_per_execution` batches
        outputs = [one_step(batch) for batch in batches]
        return tree.map_structure(lambda *parts: concat(list(parts)), *outputs)

    def make_predict_function(force=False):
        if model.predict_function is None or force:
            model.predict_function = predict_function
        return model.predict_function

    override(model, "make_predict_function", make_predict_function)


def _configure_heartbeats(environment: TFConfigEnvironment, policy: timeouts.StepTimeout) -> None:
    """Starts TensorFlow's coordination service as MultiWorkerMirroredStrategy would, with
    the step timeout's later value as its heartbeat timeout.

    TensorFlow's own is 10 s: on a loaded machine (the suite, two groups on 2 cores) a
    worker's heartbeat thread went 10 s unscheduled and the service ended a healthy job.
    The strategy configures no service of its own once one is configured.
    """
    import tensorflow as tf
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    if environment.task_type not in TFConfigEnvironment.TRAINERS or context.context().coordination_service is not None:
        return
    leader = multi_worker_util.coordination_leader(tf.train.ClusterSpec(environment.cluster))
    context.context().configure_coordination_service(service_type="standalone", service_leader=leader,
                                                     heartbeat_timeout_in_ms=int(policy.later * 1000))
    # Added to the stored configuration: where its message class lives moves between releases.
    for kind in TFConfigEnvironment.TRAINERS:
        if environment.cluster.get(kind):
            context.context().coordination_service.coordinated_job_list.add(name=kind,
                                                                           num_tasks=len(environment.cluster[kind]))


def _make_strategy(chosen: Settings, environment: TFConfigEnvironment) -> "tf.distribute.MultiWorkerMirroredStrategy":
    import tensorflow as tf

    from keras_dist.keras_workarounds import with_undivided_losses

    class PreShardedMultiWorkerMirroredStrategy(with_undivided_losses(tf.distribute.MultiWorkerMirroredStrategy)):
        """Takes each worker's dataset as that worker's shard (keras_dist split it).

        TF would auto-shard the dataset again and split every batch across all the
        cluster's replicas; here each local replica gets whole batches of the process
        batch divided by the local replica count, and steps stay as Keras counts them.
        """

        def __init__(self):
            # Keras all-reduces the gradients once all exist, as one concatenated tensor
            # unless packs are set: TensorFlow then starts each pack, last layers first,
            # as soon as its gradients exist, while the backward pass goes on.
            packs = tf.distribute.experimental.CommunicationOptions(bytes_per_pack=bucket_bytes(PACK_BYTES, chosen))
            super().__init__(communication_options=packs)

        def experimental_distribute_dataset(self, dataset, options=None):
            from keras_dist.inputs import tf_data

            return tf_data.distribute_share(self, dataset, options)

    # Before the strategy, which configures a coordination service only where none is.
    _configure_heartbeats(environment, timeouts.policy(chosen))
    try:
        return PreShardedMultiWorkerMirroredStrategy()
    except RuntimeError as exc:
        if "program startup" not in str(exc):
            raise
        raise KerasDistError(
            "TensorFlow was already running when keras_dist started MultiWorkerMirroredStrategy; "
            "`import keras_dist` before building any model or running TensorFlow ops"
        ) from None
