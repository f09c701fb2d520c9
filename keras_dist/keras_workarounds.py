"""The one place for Keras 3 bugs under `tf.distribute`, each worked around per model.

Every workaround names its upstream issue, changes one model instance only (never a
Keras class), and has a test in `tests/` that asserts plain Keras still fails: when that
test fails, upstream fixed the bug and the workaround can go. Strategies declare the
ones their models need (`TFDistributeStrategy.keras_workarounds`); nothing here asks
which strategy it is.
"""

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from keras import tree
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from keras_dist import keras_internals
from keras_dist.overrides import override, set_while


def build_from_local_batch(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Builds the model from the input's element spec instead of a reduced distributed batch.

    Upstream: tensorflow/tensorflow#72388, keras-team/keras#20585. Before the first step
    Keras's TF trainer (`_maybe_symbolic_build`) takes a batch from an iterator it then
    drops and calls `strategy.reduce("MEAN", batch)` on the whole `(x, y)` structure to
    get shapes; MultiWorkerMirroredStrategy cannot reduce a nested structure and fails
    with `Attempt to convert a value (PerReplica:...)`. Only shapes and dtypes are
    needed, which the dataset's element spec has: no batch is read, so the pipeline
    preprocesses nothing twice and a seeded shuffle starts where one process's does.

    Args:
        model: the model; its `_maybe_symbolic_build` is replaced on this instance only.
        strategy: the strategy the model trains under.
    """

    def _maybe_symbolic_build(iterator=None, data_batch=None):
        if type(model).call is keras.Model.call:
            # No `call()` (the guide's GAN: sub-models and a `train_step` of its own): nothing
            # to build from a batch; its step builds what it uses, as without a strategy.
            # Plain Keras fails here under any strategy since keras-team/keras#19969 (see #20045).
            return
        if iterator is not None:
            data_batch = iterator.data_adapter.get_tf_dataset().element_spec
        with strategy.scope():
            keras_internals.symbolic_build(model, data_batch)

    override(model, "_maybe_symbolic_build", _maybe_symbolic_build)


def step_functions(model: keras.Model, strategy: tf.distribute.Strategy, *, scalar_logs: bool = False,
                   skip_empty_batches: bool = False) -> None:
    """Builds the train and test functions with fixes for tf.distribute strategies.

    1. With `scalar_logs`. Upstream: tensorflow/tensorflow#72388, keras-team/keras#20585.
       After each step Keras reduces the logs with `strategy.reduce("MEAN", value, axis=0)`;
       under MultiWorkerMirroredStrategy the logs are scalars and the step fails with
       `Invalid reduction dimension 0 for input with 0 dimensions`. Scalars are
       averaged over replicas here (`axis=None`), other values as Keras does; a log
       that is a variable (a metric whose `result()` is its state) is read on each
       replica first, as a mirrored variable cannot be reduced.
    2. Upstream: keras-team/keras#19246. For `steps_per_execution > 1` Keras runs each
       step inside `tf.cond(has_next_batch, ...)`; under MirroredStrategy the step's
       cross-replica `merge_call` (the optimizer update) cannot sit in a conditional
       branch and the first call fails with `You must feed a value for placeholder
       tensor`. Here the condition is the `tf.while_loop` predicate, as in tf.keras.
    3. With `skip_empty_batches`. Not an upstream bug: keras_dist feeds MultiWorkerMirroredStrategy open-ended
       evaluation inputs, and its partial-batch handling gives a worker without data an
       empty batch, also in the final call that then ends the input. Keras's test step
       would count it (a multi-output model's per-output loss trackers add one update
       per call, whatever the batch size), so an empty batch skips the step.

    Args:
        model: the model; its `_make_function` is replaced on this instance only.
        strategy: the strategy that runs the steps.
    """
    keras_make_function = keras_internals.step_function_maker(model)

    def reduce_logs(outputs):
        if not scalar_logs:
            return keras_internals.reduce_per_replica(outputs, strategy, reduction="auto")

        def mean(value):
            axis = None if value.shape.rank == 0 else 0
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=axis)

        return tree.map_structure(mean, outputs)

    def _make_function(step_function):
        if model.run_eagerly:
            return keras_make_function(step_function)
        skip_empty = skip_empty_batches and step_function == model.test_step and \
            type(model).test_step is keras_internals.tensorflow_trainer().test_step

        def replica_step(data):
            # A metric's `result()` may be its state variable, which strategy.run returns
            # as one mirrored value that cannot be reduced: read it on each replica instead.
            if skip_empty:
                rows = tf.shape(next(t for t in tree.flatten(data) if t is not None))[0]
                return tf.cond(rows > 0, lambda: tree.map_structure(_read_variable, step_function(data)),
                               lambda: tree.map_structure(_read_variable, model.get_metrics_result()))
            return tree.map_structure(_read_variable, step_function(data))

        @tf.function(reduce_retracing=True, jit_compile=model.jit_compile)
        def one_step(data):
            with losses_not_divided(strategy):
                outputs = strategy.run(replica_step, args=(data,))
            return reduce_logs(outputs)

        @tf.function(reduce_retracing=True)
        def steps(iterator):
            # Out of data before the first step: OutOfRangeError, which Keras's epoch
            # iterator turns into the end of the epoch.
            outputs = one_step(iterator.get_next())
            if model.steps_per_execution == 1:
                return outputs

            def more(step, outputs, next_batch):
                return tf.logical_and(step < model.steps_per_execution, next_batch.has_value())

            def body(step, outputs, next_batch):
                outputs = one_step(next_batch.get_value())
                # Fetch only if another step follows: the batch would be lost otherwise.
                next_batch = tf.cond(step + 1 < model.steps_per_execution, iterator.get_next_as_optional, lambda: next_batch)
                return step + 1, outputs, next_batch

            _, outputs, _ = tf.while_loop(more, body, [tf.constant(1), outputs, iterator.get_next_as_optional()])
            return outputs

        return steps

    override(model, "_make_function", _make_function)


def losses_not_divided(strategy: tf.distribute.Strategy) -> contextlib.AbstractContextManager[None]:
    """While tracing a step, Keras does not divide losses by the number of replicas.

    Upstream design (keras/src/losses/loss.py, `scale_loss_for_distribution`): under
    tf.distribute every Keras loss is divided by `num_replicas_in_sync` so that the
    strategy's sum of gradients is a mean, and only Keras's own `train_step` multiplies
    its logged loss back. A custom `train_step` that logs `tracker.update_state(loss)`
    (Keras's guide) then logs 1/N of the loss, and one that computes its loss with plain
    ops gets N times the gradient. keras_dist's MultiWorkerMirrored and Mirrored
    strategies (`with_undivided_losses`) report one replica while a step is traced, so
    losses stay as one process computes them, and their optimizers divide each
    replica's gradients by the replica count instead. Other strategies are left as
    they are.
    """
    if not hasattr(strategy, UNDIVIDED_LOSSES):
        return contextlib.nullcontext()
    return set_while(strategy, UNDIVIDED_LOSSES, True)


# The attribute of a strategy made by `with_undivided_losses`.
UNDIVIDED_LOSSES = "keras_dist_one_replica_for_losses"


def with_undivided_losses(strategy_class: type) -> type:
    """`strategy_class` with a switch that makes it report one replica while set.

    Keras divides every loss by `num_replicas_in_sync` inside a step; keras_dist sets the
    switch while it traces a step (`losses_not_divided`), so losses and their logs are
    one process's, and divides each replica's gradients instead
    (`TFDistributeStrategy.distribute_optimizer`).
    """

    class UndividedLosses(strategy_class):
        @property
        def num_replicas_in_sync(self):
            return 1 if getattr(self, UNDIVIDED_LOSSES) else super().num_replicas_in_sync

    setattr(UndividedLosses, UNDIVIDED_LOSSES, False)
    UndividedLosses.__name__ = strategy_class.__name__
    return UndividedLosses


def _read_variable(value):
    return tf.convert_to_tensor(value) if isinstance(value, (tf.Variable, keras.Variable)) else value


def metric_increments_added_once(model: keras.Model, strategy: tf.distribute.Strategy | None = None) -> None:
    """Makes metric states add each replica's increment once under CentralStorageStrategy.

    Upstream: keras-team/keras#21054 (metric states wrong under tf.distribute). Keras 3
    implements `Variable.assign_add(delta)` as `assign(self + delta)`. Under
    CentralStorageStrategy a metric state is one variable on the CPU, aggregated with
    SUM, and an `assign` from replica context stores the sum of the replicas' values:
    every update adds the old total once more per extra replica, so losses and metrics
    (in `fit`'s logs and `evaluate`'s result) grow wrong from the second step on. Here
    the model's metric variables add through TensorFlow's own `assign_add`, which sums
    the replicas' increments and adds them once.

    Args:
        model: the model; its `_make_function` is wrapped on this instance only, to
            reach metric variables built after compile (Keras builds them before it
            makes the step functions), and only those variables are changed.
        strategy: unused; every workaround a strategy declares takes (model, strategy).
    """
    make_function = keras_internals.step_function_maker(model)

    def _make_function(step_function):
        for variable in model.metrics_variables:
            for name in ("assign_add", "assign_sub"):
                override(variable, name, _tf_update(variable, name))
        return make_function(step_function)

    override(model, "_make_function", _make_function)


def _tf_update(variable, name):
    def update(delta):
        tf_variable = keras_internals.variable_value(variable)
        return getattr(tf_variable, name)(tf.cast(delta, tf_variable.dtype))

    return update


def layer_state_aggregated(model: keras.Model, strategy: tf.distribute.Strategy) -> None:
    """Lets layers update their own state from replica context under CentralStorageStrategy.

    Upstream: keras-team/keras#20611 and keras-team/keras#20541. Keras creates layer
    state that the forward pass assigns (BatchNormalization's moving statistics,
    Dropout's seed state) with aggregation "none". MirroredStrategy keeps a copy per
    replica; CentralStorageStrategy keeps one, refuses such an assign from replica
    context and the first training step fails with `You must specify an aggregation
    method to update a AggregatingVariable in Replica Context`. Here each such variable
    is re-created, value kept, with aggregation MEAN (floats: the replicas' moving
    statistics are averaged, as tf.keras did) or ONLY_FIRST_REPLICA (integers: every
    replica computes the same next seed).

    Args:
        model: the model; its `_make_function` is wrapped on this instance only, to
            reach state that layers create when they are built, inside `fit`.
        strategy: the model's CentralStorageStrategy.
    """
    make_function = keras_internals.step_function_maker(model)

    def _make_function(step_function):
        for variable in model.non_trainable_variables:
            tf_variable = keras_internals.variable_value(variable)
            if variable.aggregation == "none" and tf_variable is not None:
                value = tf.convert_to_tensor(tf_variable)
                keras_internals.set_variable_aggregation(variable, "mean" if value.dtype.is_floating
                                                         else "only_first_replica")
                with strategy.scope(), tf.init_scope():
                    keras_internals.initialize_variable(variable, value)
        return make_function(step_function)

    override(model, "_make_function", _make_function)


# --- keras-team/keras#18624: variables a partitioner split over parameter servers ------
# A ParameterServerStrategy with a `variable_partitioner` creates each large variable as
# a `ShardedVariable`: one `tf.Variable` per shard, spread over the ps tasks. Keras 3's
# TF backend expects one variable behind each Keras variable: `train_step` fails in
# `GradientTape.gradient` (`'ShardedVariable' object has no attribute 'handle'`), the
# optimizer's update in `strategy.extended.update` and its slot variables in
# `colocate_vars_with` (`ShardedVariable doesn't support being used as a reference`).


def is_sharded(variable: keras.Variable) -> bool:
    """Whether a Keras variable is backed by a `ShardedVariable`."""
    return isinstance(keras_internals.variable_value(variable), ShardedVariable)


def sharded_variable_updates(optimizer: keras.optimizers.Optimizer) -> None:
    """Makes a Keras optimizer update sharded variables and create their slots.

    Upstream: keras-team/keras#18624. A sharded variable is updated in place, each
    shard on its ps task, instead of through `strategy.extended.update`, which needs
    one variable to colocate with; its slot variables (Adam's moments) are created
    without colocation, so the partitioner splits them like the variable.

    Args:
        optimizer: a Keras optimizer of the TF backend; two methods are replaced on
            this instance only. Variables that are not sharded take Keras's path.
    """
    keras_add_slot = optimizer.add_variable_from_reference
    keras_update = keras_internals.tf_distributed_update(optimizer)

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        if is_sharded(reference_variable):
            return keras_internals.base_optimizer().add_variable_from_reference(optimizer, reference_variable, name,
                                                                                initializer)
        return keras_add_slot(reference_variable, name=name, initializer=initializer)

    def _distributed_tf_update_step(distribution, grads_and_vars, learning_rate):
        sharded = [(g, v) for g, v in grads_and_vars if isinstance(v, ShardedVariable)]
        keras_update(distribution, [(g, v) for g, v in grads_and_vars if not isinstance(v, ShardedVariable)],
                     learning_rate)
        for gradient, variable in sharded:
            optimizer.update_step(gradient, variable, learning_rate)

    override(optimizer, "add_variable_from_reference", add_variable_from_reference)
    override(optimizer, "_distributed_tf_update_step", _distributed_tf_update_step)


def train_step_over_shards(model: keras.Model) -> Callable[[Any], dict[str, Any]] | None:
    """Keras's training step for a model with sharded variables; None if it has none.

    Upstream: keras-team/keras#18624. The same forward pass, loss, loss tracking and
    metrics as Keras's TF `train_step`, but the gradient is taken with respect to each
    shard and joined back per Keras variable; an `Embedding`'s row slices stay sparse.

    Args:
        model: a built, compiled model whose optimizer went through
            `sharded_variable_updates`.

    Returns:
        A function of one batch, or None when no trainable variable is sharded.
    """
    if not any(is_sharded(w) for w in model.trainable_weights):
        return None

    def train_step(data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True) if keras_internals.call_has_training_argument(model) else model(x)
            loss = keras_internals.compute_loss(model, x, y, y_pred, sample_weight=sample_weight, training=True)
            batch_size = tf.shape(next(t for t in tree.flatten(x) if t is not None))[0]
            keras_internals.loss_tracker(model).update_state(keras_internals.unscale_loss_for_distribution(loss),
                                                             sample_weight=batch_size)
            loss = model.optimizer.scale_loss(loss)
        weights = model.trainable_weights
        sources = [list(keras_internals.variable_value(w).variables) if is_sharded(w) else w for w in weights]
        gradients = tape.gradient(loss, sources)
        joined = [_joined(g, s) if is_sharded(w) else g for g, s, w in zip(gradients, sources, weights)]
        model.optimizer.apply_gradients(zip(joined, weights))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    return train_step


def sharded_variables_savable(variables: Iterable[keras.Variable]) -> None:
    """Lets Keras save sharded variables: `np.asarray` of them joins their shards.

    Upstream: keras-team/keras#18624. Keras saves weights (`save_weights`, `save`,
    ModelCheckpoint, BackupAndRestore) through `np.asarray(variable)`, which calls
    `__array__` on the backing TensorFlow variable; a `ShardedVariable` has none.

    Args:
        variables: Keras variables; each sharded one's `ShardedVariable` becomes an
            instance of a subclass that adds `__array__`, nothing else changed.
    """
    for variable in variables:
        if is_sharded(variable):
            keras_internals.variable_value(variable).__class__ = _SavableShardedVariable


class _SavableShardedVariable(ShardedVariable):
    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.numpy(), dtype=dtype)


def _joined(shard_gradients, shards):
    """One gradient for a sharded variable from its shards' gradients (rows concatenated)."""
    if all(g is None for g in shard_gradients):
        return None
    if all(isinstance(g, tf.IndexedSlices) for g in shard_gradients):
        offsets = np.cumsum([0] + [s.shape[0] for s in shards[:-1]])
        total_rows = sum(s.shape[0] for s in shards)
        return tf.IndexedSlices(
            tf.concat([g.values for g in shard_gradients], 0),
            tf.concat([g.indices + tf.cast(o, g.indices.dtype) for g, o in zip(shard_gradients, offsets)], 0),
            dense_shape=tf.constant([total_rows, *shards[0].shape[1:]], tf.int64))
    return tf.concat([tf.zeros(s.shape, s.dtype) if g is None else tf.convert_to_tensor(g)
                      for g, s in zip(shard_gradients, shards)], 0)
