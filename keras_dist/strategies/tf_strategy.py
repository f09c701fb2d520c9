"""What every `tf.distribute` backend shares: the strategy's scope and moving a model under it.

A strategy replicates variables and reduces gradients and metric states inside Keras, so
these backends hand out `strategy.scope()` and say how inputs are split; keras_dist does
no reduction of its own (`reduces_in_keras_dist` stays False).
"""

import contextlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np
import tensorflow as tf

from keras_dist import keras_internals, keras_workarounds
from keras_dist.errors import KerasDistError
from keras_dist.keras_workarounds import UNDIVIDED_LOSSES
from keras_dist.replicas import MetricStates, Replicas
from keras_dist.strategies.base import Strategy, GradientOptions
from keras_dist.settings import Settings
from keras_dist.environments import ClusterEnvironment

if TYPE_CHECKING:
    import keras


class TFDistributeMetricStates(MetricStates):
    """Metric states held in a `tf.distribute` strategy's per-replica variables."""

    def __init__(self, replicas: Replicas, tf_strategy: tf.distribute.Strategy):
        super().__init__(replicas)
        self.tf_strategy = tf_strategy

    def global_values(self, variables: Sequence["keras.Variable"]) -> list:
        """Summed over processes explicitly, each process's replicas first: reading a
        per-replica (sync-on-read) variable may itself aggregate over every worker,
        depending on the context."""
        def this_process(variable):
            value = variable.value
            if isinstance(value, tf.distribute.DistributedValues):
                return np.sum([np.asarray(part) for part in self.tf_strategy.experimental_local_results(value)], axis=0)
            return np.asarray(value)

        return self.replicas.collectives.sum_arrays([this_process(v) for v in variables])

    def assign_global(self, variables: Sequence["keras.Variable"], global_states: Sequence[np.ndarray]) -> None:
        """The chief holds the states, the others zero, as every strategy does; but a value
        assigned to a sum-aggregated sync-on-read variable outside a replica is divided by
        the job's replicas, this process's local replicas each taking that share, so it is
        scaled up by the process's part of the replicas first."""
        for variable, value in zip(variables, global_states):
            share = value if self.replicas.is_chief else np.zeros_like(value)
            tf_variable = variable.value
            if (isinstance(tf_variable, tf.distribute.DistributedValues)
                    and tf_variable.aggregation == tf.VariableAggregation.SUM
                    and tf_variable.synchronization == tf.VariableSynchronization.ON_READ):
                share = share * self.tf_strategy.num_replicas_in_sync / len(
                    self.tf_strategy.experimental_local_results(tf_variable))
            variable.assign(share)


class TFDistributeStrategy(Strategy):
    """A backend whose replicas are run by one `tf.distribute.Strategy`.

    Subclasses implement `make_strategy`; single-process strategies keep `rank` 0 and
    `size` 1 and feed `num_replicas` replicas from one input pipeline.
    """

    # What this strategy's models need from `keras_dist.keras_workarounds`, applied in
    # order to each model it prepares: functions of (model, tf.distribute strategy).
    keras_workarounds: ClassVar[tuple[Callable, ...]] = (keras_workarounds.build_from_local_batch,
                                                        keras_workarounds.step_functions)

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        super().__init__(environment, chosen)
        self.strategy = self.make_strategy()
        self.metric_states = TFDistributeMetricStates(self, self.strategy)

    def make_strategy(self) -> tf.distribute.Strategy:
        """The `tf.distribute.Strategy` this backend runs (called once, in `__init__`)."""
        raise NotImplementedError

    @property
    def num_replicas(self) -> int:
        return self.strategy.num_replicas_in_sync

    def scope(self) -> contextlib.AbstractContextManager[Any]:
        return self.strategy.scope()

    def prepare_model(self, model: "keras.Model") -> "keras.Model":
        """Moves `model`'s variables under the strategy, in place, keeping their values.

        The usual script builds its model before `keras_dist.compile`, outside any scope;
        each Keras variable then gets a new strategy-created `tf.Variable` holding its
        current value, so the user's `model` object (and any reference to its layers or
        weights) stays valid.
        """
        move_variables(model, self.strategy)
        # Keras reads the strategy from the model, set when it is built under a scope.
        keras_internals.set_distribute_strategy(model, self.strategy)
        for workaround in self.keras_workarounds:
            workaround(model, self.strategy)
        return model

    def distribute_optimizer(self, optimizer: "keras.optimizers.Optimizer", options: GradientOptions) -> None:
        # The strategy sums gradients; each replica's are divided by the replica count
        # first (by Keras's loss scaling, or below where losses are not divided): a mean.
        if options.reduction != "mean":
            raise KerasDistError(
                f"backend {self.name!r} always averages gradients across replicas; "
                "drop gradient_reduction='sum' (or scale the loss yourself)"
            )
        if options.compression:  # tf.distribute's collectives have no wire dtype of their own
            raise KerasDistError(f"backend {self.name!r} all-reduces gradients as they are; drop "
                                 "gradient_compression, or train under horovodrun to compress them")
        adopt_optimizer(optimizer, self.strategy)
        if hasattr(self.strategy, UNDIVIDED_LOSSES):
            from keras_dist import optimizer_hooks

            replicas = self.num_replicas
            optimizer_hooks.reduce_gradients_before_update(optimizer, lambda grads: [_divided(g, replicas) for g in grads])

    def describe(self) -> dict:
        return {**super().describe(), "strategy": type(self.strategy).__name__}


def _divided(gradient, count):
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(gradient.values / count, gradient.indices, gradient.dense_shape)
    return gradient / tf.cast(count, gradient.dtype)


def adopt_optimizer(optimizer: "keras.optimizers.Optimizer", strategy: tf.distribute.Strategy) -> None:
    """Puts a Keras optimizer made outside any scope (the usual script) under `strategy`.

    A Keras optimizer keeps the strategy current when it was made; building its slots
    (Adam's moments) under another one fails with "Mixing different tf.distribute.Strategy
    objects". Its variables move too, values kept, and a built optimizer (a loaded
    model's) is told the model's moved variables are the ones it was built for.

    Args:
        optimizer: the compiled model's optimizer (a `LossScaleOptimizer`'s inner one too).
        strategy: the `tf.distribute.Strategy` the model trains under.
    """
    for part in (optimizer, getattr(optimizer, "inner_optimizer", None)):
        if part is not None:
            move_variables(part, strategy)
            keras_internals.set_optimizer_strategy(part, strategy)
            if part.built:  # a loaded model's: its index is keyed by the TF variables just replaced
                keras_internals.reindex_optimizer_variables(part)


def local_replica_devices(backend_name: str) -> list[str]:
    """Devices for one replica each: every local GPU, else every logical CPU device.

    Logical CPU devices (`tf.config.set_logical_device_configuration`) let a
    multi-replica strategy run, and be tested, on a machine without GPUs.

    Args:
        backend_name: the backend asking, named in the error when there is no device.

    Example:

    ```python
    tf.distribute.MirroredStrategy(local_replica_devices("mirrored"))
    ```
    """
    devices = [d.name for d in tf.config.list_logical_devices("GPU")]
    if not devices:
        devices = [d.name for d in tf.config.list_logical_devices("CPU")]
    if not devices:
        raise KerasDistError(f"backend {backend_name!r} found no GPU or CPU device; check CUDA_VISIBLE_DEVICES")
    return devices


def move_variables(model: "keras.Model | keras.optimizers.Optimizer", strategy: tf.distribute.Strategy) -> None:
    """Re-creates every initialized variable of `model` under `strategy`, values kept.

    Args:
        model: a `keras.Model`, built or not (unbuilt layers are created later, under
            the scope `keras_dist.compile` opens, or by Keras's build inside `fit`), or
            a Keras optimizer (its step counter and learning rate).
        strategy: the `tf.distribute.Strategy` the variables must belong to.

    Example:

    ```python
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    move_variables(model, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
    ```
    """
    for variable in model.variables:
        current = keras_internals.variable_value(variable)
        if current is None:  # not yet initialized: it will be created on first use
            continue
        if getattr(current, "_distribute_strategy", None) is strategy:
            continue
        value = tf.convert_to_tensor(current)
        # The new TensorFlow variable keeps the old one's `trainable` (which gradient tapes
        # watch), not the Keras flag of the moment: a layer frozen now and unfrozen for a
        # second compile (the transfer-learning recipe) must still get gradients.
        # init_scope: create eagerly even if a script calls compile inside a tf.function.
        with strategy.scope(), tf.init_scope():
            keras_internals.initialize_variable(variable, value, trainable=current.trainable)
