"""The one place for Keras 3 bugs under `tf.distribute`, each worked around per model.

Every workaround names its upstream issue, changes one model instance only (never a
Keras class), and has a test in `tests/` that asserts plain Keras still fails: when that
test fails, upstream fixed the bug and the workaround can go.
"""

import tensorflow as tf
from keras import tree


def apply(model, strategy):
    """Installs every workaround `strategy` needs on `model` (idempotent).

    Args:
        model: the `keras.Model` keras_dist is compiling.
        strategy: the `tf.distribute.Strategy` it will train under.

    Example:

    ```python
    keras_workarounds.apply(model, backend.strategy)
    ```
    """
    build_from_local_batch(model, strategy)
    if not isinstance(strategy, tf.distribute.TPUStrategy):
        step_functions(model, strategy)
    if isinstance(strategy, tf.distribute.experimental.CentralStorageStrategy):
        metric_increments_added_once(model)
        layer_state_aggregated(model, strategy)


def build_from_local_batch(model, strategy):
    """Builds the model from one replica's batch instead of a reduced distributed batch.

    Upstream: tensorflow/tensorflow#72388, keras-team/keras#20585. Before the first step
    Keras's TF trainer (`_maybe_symbolic_build`) calls `strategy.reduce("MEAN", batch)`
    on the whole `(x, y)` structure to get shapes; MultiWorkerMirroredStrategy cannot
    reduce a nested structure and fails with `Attempt to convert a value (PerReplica:...)`.
    Only shapes and dtypes are needed, which the first replica's batch has.

    Args:
        model: the model; its `_maybe_symbolic_build` is replaced on this instance only.
        strategy: the strategy whose per-replica batches reach the model.
    """

    def _maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None:
            for _, _, it in iterator:
                data_batch = next(it)
                break
        data_batch = tree.map_structure(lambda v: _first_replica(strategy, v), data_batch)
        with strategy.scope():
            model._symbolic_build(data_batch=data_batch)

    object.__setattr__(model, "_maybe_symbolic_build", _maybe_symbolic_build)


def _first_replica(strategy, value):
    if isinstance(value, tf.distribute.DistributedValues):
        return strategy.experimental_local_results(value)[0]
    return value


def step_functions(model, strategy):
    """Builds the train and test functions with two fixes for tf.distribute strategies.

    1. Upstream: tensorflow/tensorflow#72388, keras-team/keras#20585. After each step
       Keras reduces the logs with `strategy.reduce("MEAN", value, axis=0)`; under
       MultiWorkerMirroredStrategy the logs are scalars and the step fails with
       `Invalid reduction dimension 0 for input with 0 dimensions`. Scalars are
       averaged over replicas here (`axis=None`), other values as Keras does.
    2. Upstream: keras-team/keras#19246. For `steps_per_execution > 1` Keras runs each
       step inside `tf.cond(has_next_batch, ...)`; under MirroredStrategy the step's
       cross-replica `merge_call` (the optimizer update) cannot sit in a conditional
       branch and the first call fails with `You must feed a value for placeholder
       tensor`. Here the condition is the `tf.while_loop` predicate, as in tf.keras.

    Args:
        model: the model; its `_make_function` is replaced on this instance only.
        strategy: the strategy that runs the steps.
    """
    from keras.src.backend.tensorflow.trainer import reduce_per_replica

    keras_make_function = model._make_function
    multi_worker = isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy)

    def reduce_logs(outputs):
        if not multi_worker:
            return reduce_per_replica(outputs, strategy, reduction="auto")

        def mean(value):
            axis = None if value.shape.rank == 0 else 0
            return strategy.reduce(tf.distribute.ReduceOp.MEAN, value, axis=axis)

        return tree.map_structure(mean, outputs)

    def _make_function(step_function):
        if model.run_eagerly:
            return keras_make_function(step_function)

        @tf.function(reduce_retracing=True, jit_compile=model.jit_compile)
        def one_step(data):
            return reduce_logs(strategy.run(step_function, args=(data,)))

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

    object.__setattr__(model, "_make_function", _make_function)


def metric_increments_added_once(model):
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
    """
    make_function = model._make_function

    def _make_function(step_function):
        for variable in model.metrics_variables:
            for name in ("assign_add", "assign_sub"):
                object.__setattr__(variable, name, _tf_update(variable, name))
        return make_function(step_function)

    object.__setattr__(model, "_make_function", _make_function)


def _tf_update(variable, name):
    def update(delta):
        tf_variable = variable._value
        return getattr(tf_variable, name)(tf.cast(delta, tf_variable.dtype))

    return update


def layer_state_aggregated(model, strategy):
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
    make_function = model._make_function

    def _make_function(step_function):
        for variable in model.non_trainable_variables:
            if variable.aggregation == "none" and variable._value is not None:
                value = tf.convert_to_tensor(variable._value)
                variable._aggregation = "mean" if value.dtype.is_floating else "only_first_replica"
                with strategy.scope(), tf.init_scope():
                    variable._initialize(value)
        return make_function(step_function)

    object.__setattr__(model, "_make_function", _make_function)
