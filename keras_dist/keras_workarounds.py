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
