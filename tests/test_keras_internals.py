"""Canaries for the private Keras names keras_dist uses, all through keras_dist.keras_internals.

One test per name, checking what keras_dist relies on (a tiny call, not only the import);
a failure says which Keras internal moved or changed and what in keras_dist depends on it.
A new Keras release (tools/keras_nightly.py) fails here first, with the place to adapt.
"""

import contextlib
import inspect
import json
import os
import sys

import keras
import numpy as np
import pytest

from keras_dist import keras_internals
from keras_dist.overrides import override
from runner import PYTHON, run


@contextlib.contextmanager
def canary(internal, user):
    """Turns any failure inside into one line: the Keras internal that changed, and its user."""
    try:
        yield
    except Exception as error:  # noqa: BLE001 - an import, a signature or a value alike
        pytest.fail(f"{internal} moved or changed under Keras {keras.__version__} ({type(error).__name__}: {error}): "
                    f"{user}", pytrace=False)


def exported():
    return sorted(name for name, value in vars(keras_internals).items()
                  if inspect.isfunction(value) and value.__module__ == keras_internals.__name__ and name[0] != "_")


def test_every_internal_has_a_docstring_and_a_canary():
    for name in exported():
        doc = (getattr(keras_internals, name).__doc__ or "").strip()
        assert doc and "\n" not in doc, f"keras_internals.{name} needs a one-line docstring: its use, why not public"
        assert f"test_{name}" in globals(), f"keras_internals.{name} has no canary test_{name} in {__file__}"


@pytest.mark.parametrize("keras_backend", ["jax", "torch"])
def test_the_canaries_under_the_other_keras_backends(keras_backend):
    # This process runs one Keras backend; each canary of another backend's internals (and
    # each name the three share) runs here under that backend too.
    if keras.backend.backend() != "tensorflow":
        pytest.skip("run from the TensorFlow process")
    code, out = run([PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
                     "not under_the_other_keras_backends"], timeout=600, env={"KERAS_BACKEND": keras_backend})
    assert code == 0, out[-4000:]


def only_under(backend):
    """Skips a canary of one Keras backend's internal where the test process runs another."""
    if keras.backend.backend() != backend:
        pytest.skip(f"an internal of Keras's {backend} backend; this process runs {keras.backend.backend()}")


# --- the TensorFlow trainer --------------------------------------------------------------------


def test_reduce_per_replica():
    tf = pytest.importorskip("tensorflow")
    with canary("keras.src.backend.tensorflow.trainer.reduce_per_replica",
                "keras_dist.keras_workarounds (the MirroredStrategy step function) reduces non-scalar logs with it"):
        logs = {"loss": tf.constant(2.0), "outputs": tf.constant([1.0, 2.0])}
        reduced = keras_internals.reduce_per_replica(logs, tf.distribute.get_strategy(), reduction="auto")
        assert float(reduced["loss"]) == 2.0 and reduced["outputs"].numpy().tolist() == [1.0, 2.0]


def test_concat():
    tf = pytest.importorskip("tensorflow")
    with canary("keras.src.backend.tensorflow.trainer.concat",
                "keras_dist.strategies.multi_worker_mirrored.predict_locally joins local replicas' outputs with it"):
        joined = keras_internals.concat([tf.constant([[1], [2]]), tf.constant([[3]])])
        assert joined.numpy().tolist() == [[1], [2], [3]]
        ragged = keras_internals.concat([tf.ragged.constant([[1, 2]]), tf.ragged.constant([[3]])])
        assert ragged.to_list() == [[1, 2], [3]]


def test_tensorflow_trainer():
    pytest.importorskip("tensorflow")
    with canary("keras.src.backend.tensorflow.trainer.TensorFlowTrainer (Trainer in 3.16's nightlies)",
                "keras_dist.strategies.parameter_server.sharded_variables.train_step and keras_workarounds' "
                "empty-batch skip tell a model's own train_step/test_step from its"):
        trainer = keras_internals.tensorflow_trainer()
        assert issubclass(trainer, keras_internals.trainer_mixin()) and callable(trainer.train_step)
        if keras.backend.backend() == "tensorflow":
            assert keras.Model.train_step is trainer.train_step and keras.Model.test_step is trainer.test_step


def test_step_function_maker():
    only_under("tensorflow")
    with canary("keras.src.backend.tensorflow.trainer.TensorFlowTrainer._make_function",
                "keras_dist.keras_workarounds (step functions, metric increments, layer state) wrap it on one model"):
        model = compiled_model()
        keras_make_function = keras_internals.step_function_maker(model)
        steps = []
        # Keras makes each function through the instance's attribute: a replacement there is used.
        override(model, "_make_function", lambda step: steps.append(step) or keras_make_function(step))
        model.fit(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
        model.evaluate(np.ones((4, 3)), np.ones((4, 2)), verbose=0)
        assert steps == [model.train_step, model.test_step]


def test_set_distribute_strategy():
    only_under("tensorflow")
    import tensorflow as tf

    with canary("keras.src.backend.tensorflow.trainer.TensorFlowTrainer._distribute_strategy",
                "keras_dist.strategies.tf_strategy runs a model made outside any scope under its strategy"):
        model, strategy = tiny_model(), tf.distribute.MirroredStrategy(["/cpu:0"])
        keras_internals.set_distribute_strategy(model, strategy)
        assert model.distribute_strategy is strategy


def test_tf_distributed_update():
    only_under("tensorflow")
    import tensorflow as tf

    with canary("keras.src.backend.tensorflow.optimizer.TFOptimizer._distributed_tf_update_step",
                "keras_dist.keras_workarounds.sharded_variable_updates wraps it for sharded variables"):
        optimizer, variable = keras.optimizers.SGD(0.5), keras.Variable(np.ones(2, "float32"))
        optimizer.build([variable])
        keras_update = keras_internals.tf_distributed_update(optimizer)
        assert list(inspect.signature(keras_update).parameters) == ["distribution", "grads_and_vars", "learning_rate"]
        calls = []
        override(optimizer, "_distributed_tf_update_step", lambda *args: calls.append(args) or keras_update(*args))
        optimizer.apply_gradients([(tf.ones(2), variable)])
        assert len(calls) == 1 and variable.numpy().tolist() == [0.5, 0.5]


def test_set_optimizer_strategy():
    only_under("tensorflow")
    import tensorflow as tf

    with canary("keras.src.backend.tensorflow.optimizer.TFOptimizer._distribution_strategy",
                "keras_dist.strategies.tf_strategy.adopt_optimizer puts an optimizer made outside any scope under "
                "its strategy"):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            variable = keras.Variable(np.ones(2, "float32"))
        optimizer = keras.optimizers.Adam()  # outside: Keras would build its slots under the default strategy
        keras_internals.set_optimizer_strategy(optimizer, strategy)
        with strategy.scope():
            optimizer.build([variable])  # else "Mixing different tf.distribute.Strategy objects"
        assert all(isinstance(keras_internals.variable_value(slot), tf.distribute.DistributedValues)
                   for slot in optimizer.variables if slot.shape == (2,))


# --- trainers, optimizers, losses --------------------------------------------------------------


def test_trainer_mixin():
    with canary("keras.src.trainers.trainer.Trainer (BaseTrainer in 3.16's nightlies)",
                "keras_dist.compile accepts layers that mix it in, as Keras's own test suites compile them"):
        mixin = keras_internals.trainer_mixin()
        assert issubclass(keras.Model, mixin) and callable(mixin.compile)


def compiled_model(**compile_options):
    model = tiny_model()
    model.compile(optimizer=compile_options.pop("optimizer", "sgd"), loss="mse", **compile_options)
    return model


def test_symbolic_build():
    with canary("keras.src.trainers.trainer.Trainer._symbolic_build",
                "keras_dist's parameter-server loop builds a model's metrics and optimizer before any step with it"):
        model = compiled_model(metrics=["mae"])
        before = len(model.metrics_variables)
        keras_internals.symbolic_build(model, (np.ones((2, 3)), np.ones((2, 2))))
        assert model.optimizer.built and len(model.metrics_variables) > before


def test_should_evaluate():
    with canary("keras.src.trainers.trainer.Trainer._should_eval",
                "keras_dist's parameter-server loop validates after the epochs fit would with it"):
        model = compiled_model()
        assert [keras_internals.should_evaluate(model, epoch, 2) for epoch in range(4)] == [False, True, False, True]
        assert [keras_internals.should_evaluate(model, epoch, [1, 3]) for epoch in range(4)] == [True, False, True, False]


def test_metrics_in_order():
    with canary("keras.src.trainers.trainer.Trainer._flatten_metrics_in_order",
                "keras_dist's parameter-server loop returns evaluate's list with it"):
        model = compiled_model(metrics=["mae"])
        model.evaluate(np.ones((2, 3)), np.ones((2, 2)), verbose=0)
        assert keras_internals.metrics_in_order(model, {"mae": 2.0, "loss": 1.0}) == [1.0, 2.0]


def test_call_has_training_argument():
    with canary("keras.src.layers.Layer._call_has_training_arg",
                "keras_dist.keras_workarounds.train_step_over_shards calls the model as Keras's train_step does"):
        class WithoutTraining(keras.Model):
            def call(self, x):
                return x

        assert keras_internals.call_has_training_argument(tiny_model()) is True
        assert keras_internals.call_has_training_argument(WithoutTraining()) is False


def test_compute_loss():
    with canary("keras.src.trainers.trainer.Trainer._compute_loss",
                "keras_dist.keras_workarounds.train_step_over_shards computes the loss as Keras's train_step does"):
        x, y, y_pred = np.ones((2, 3), "float32"), np.zeros((2, 2), "float32"), np.full((2, 2), 2.0, "float32")
        assert float(keras_internals.compute_loss(compiled_model(), x, y, y_pred)) == 4.0

        class ComputeLossWithoutTraining(keras.Model):  # Keras before 3.3 had no `training` there
            def call(self, x):
                return x

            def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None):
                return keras.ops.sum(y_pred)

        assert float(keras_internals.compute_loss(ComputeLossWithoutTraining(), x, y, y_pred, training=True)) == 8.0


def test_loss_tracker():
    with canary("keras.src.trainers.trainer.Trainer._loss_tracker",
                "keras_dist.keras_workarounds.train_step_over_shards records the loss log in it"):
        model = compiled_model()
        loss = model.evaluate(np.ones((4, 3)), np.zeros((4, 2)), verbose=0)
        tracker = keras_internals.loss_tracker(model)
        assert isinstance(tracker, keras.metrics.Mean) and np.isclose(float(tracker.result()), loss)


def test_learning_rate_schedule():
    with canary("keras.src.optimizers.base_optimizer.BaseOptimizer._learning_rate",
                "keras_dist.compile scales the schedule itself, not its current value, with it"):
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
        assert keras_internals.learning_rate_schedule(keras.optimizers.SGD(schedule)) is schedule
        assert float(keras_internals.learning_rate_schedule(keras.optimizers.SGD(0.25))) == 0.25


def test_optimizer_variables():
    with canary("keras.src.optimizers.base_optimizer.BaseOptimizer._trainable_variables",
                "keras_dist's torch backend buckets a built optimizer's gradients in its order with it"):
        model = compiled_model()
        model.optimizer.build(model.trainable_variables)
        assert [v.path for v in keras_internals.optimizer_variables(model.optimizer)] == [
            v.path for v in model.trainable_variables]


def test_base_metrics_result():
    with canary("keras.src.trainers.trainer's get_metrics_result (on the trainer mixin)",
                "keras_dist.keras_workarounds_torch reads a process's own metric results with it under Keras 3.16's "
                "torch trainer"):
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        model.compile(loss="mse", metrics=["mae"])
        model.evaluate(np.ones((4, 2)), np.zeros((4, 1)), verbose=0)
        assert set(keras_internals.base_metrics_result(model)) == {"loss", "mae"}


def test_torch_ddp_initializer():
    pytest.importorskip("torch")
    with canary("keras.src.backend.torch.trainer's _initialize_ddp (Keras 3.16, keras-team/keras#23316)",
                "keras_dist.keras_workarounds_torch turns Keras's DistributedDataParallel wrapping off with it"):
        name = keras_internals.torch_ddp_initializer()
        major_minor = tuple(int(part) for part in keras.__version__.split(".")[:2])
        # From 3.16 Keras wraps torch models itself: the name must be found, or two reductions run a step.
        assert (name is not None) == (major_minor >= (3, 16)), (keras.__version__, name)


def test_base_optimizer():
    with canary("keras.src.optimizers.base_optimizer.BaseOptimizer.add_variable_from_reference",
                "keras_dist.keras_workarounds.sharded_variable_updates creates sharded variables' slots with it"):
        base = keras_internals.base_optimizer()
        optimizer = keras.optimizers.SGD()
        assert isinstance(optimizer, base)
        assert list(inspect.signature(base.add_variable_from_reference).parameters)[:4] == \
            ["self", "reference_variable", "name", "initializer"]
        slot = base.add_variable_from_reference(optimizer, keras.Variable(np.ones((2, 3), "float32")), "m", "zeros")
        assert tuple(slot.shape) == (2, 3) and not np.any(keras.ops.convert_to_numpy(slot))


def test_gradient_clipper():
    with canary("keras.src.optimizers.base_optimizer.BaseOptimizer._clip_gradients",
                "keras_dist.optimizer_hooks wraps it to reduce gradients across processes before Keras clips them"):
        optimizer, variable = keras.optimizers.SGD(1.0, clipnorm=1.0), keras.Variable(np.zeros(2, "float32"))
        keras_clip = keras_internals.gradient_clipper(optimizer)
        assert np.allclose(keras.ops.convert_to_numpy(keras_clip([keras.ops.array([3.0, 4.0])])[0]), [0.6, 0.8])
        clipped = []
        override(optimizer, "_clip_gradients", lambda grads: clipped.append(len(grads)) or keras_clip(grads))
        optimizer.apply_gradients([(keras.ops.array([3.0, 4.0]), variable)])
        assert clipped == [1] and np.allclose(keras.ops.convert_to_numpy(variable), [-0.6, -0.8])


def test_reindex_optimizer_variables():
    with canary("keras.src.optimizers.base_optimizer.BaseOptimizer._trainable_variables_indices and _var_key",
                "keras_dist.strategies.tf_strategy.adopt_optimizer tells a built optimizer its moved variables"):
        model = compiled_model(optimizer="adam")
        model.optimizer.build(model.trainable_variables)
        for variable in model.trainable_variables:  # TensorFlow: new tf.Variables, which Keras keys its index by
            value = keras.ops.convert_to_tensor(keras.ops.convert_to_numpy(variable))
            keras_internals.initialize_variable(variable, value)
        keras_internals.reindex_optimizer_variables(model.optimizer)
        model.optimizer.apply_gradients([(keras.ops.ones(v.shape), v) for v in model.trainable_variables])
        assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == 1


def test_unscale_loss_for_distribution():
    with canary("keras.src.losses.loss.unscale_loss_for_distribution",
                "keras_dist.keras_workarounds.train_step_over_shards records the loss as Keras's tracker does"):
        value = keras.ops.convert_to_tensor(3.0)
        assert float(keras_internals.unscale_loss_for_distribution(value)) == 3.0  # one replica: unchanged


def test_compute_output_spec():
    with canary("keras.src.backend.compute_output_spec",
                "keras_dist.strategies.parameter_server.loop builds a model's variables before predict with it"):
        model = keras.Sequential([keras.layers.Dense(2)])
        spec = keras_internals.compute_output_spec(model, np.zeros((4, 3), "float32"))
        assert tuple(spec.shape) == (4, 2) and model.built


def test_get_data_adapter():
    with canary("keras.src.trainers.data_adapters.get_data_adapter",
                "keras_dist.strategies.parameter_server.loop reads the chief's inputs through it"):
        x = np.arange(10, dtype="float32").reshape(10, 1)
        adapter = keras_internals.get_data_adapter(x, x, None, batch_size=4, steps_per_epoch=None, shuffle=False,
                                                   class_weight=None)
        assert adapter.num_batches == 3 and callable(adapter.get_tf_dataset)



def test_keras_asks_the_global_distribution_at_every_fit():
    """`keras_dist.compiled_elsewhere.CompiledElsewhereWatch` is Keras's global distribution in a job
    of several processes: Keras's data adapter asks it `_is_multi_process` at every fit, evaluate and
    predict, and what else Keras reads of it (a dataset, layouts; on JAX a batch's placement) leaves
    Keras as it is."""
    from keras_dist.compiled_elsewhere import CompiledElsewhereWatch
    from keras_dist.errors import KerasDistError
    from keras_dist.strategies.single import SingleProcessStrategy

    x = np.arange(8, dtype="float32").reshape(4, 2)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")  # before the watch: a compile it did not see
    keras.distribution.set_distribution(CompiledElsewhereWatch(SingleProcessStrategy()))
    try:
        with canary("the global distribution's _is_multi_process, read by get_data_adapter",
                    "keras_dist.compiled_elsewhere.CompiledElsewhereWatch stops the fit of a model compiled where "
                    "keras_dist could not see it"):
            with pytest.raises(KerasDistError, match=r"keras_dist\.compile\(model\)"):
                model.fit(x, x[:, :1], verbose=0)
            assert model.predict(x, verbose=0).shape == (4, 1)
            model.evaluate(x, x[:, :1], verbose=0)
            model.train_on_batch(x, x[:, :1])  # JAX: the batch placed by its layout, not the iterator's
            import tensorflow as tf

            model.evaluate(tf.data.Dataset.from_tensor_slices((x, x[:, :1])).batch(2), verbose=0)
    finally:
        keras.distribution.set_distribution(None)


def test_compile_code():
    """Keras creates variables inside its own `compile` (its loss tracker's), whose frame
    `keras_dist.compiled_elsewhere` finds on the stack: on JAX where Keras asks the global
    distribution for a variable's layout, on TensorFlow in the thread's variable creators."""
    from keras_dist import compiled_elsewhere

    class Subclass(keras.Sequential):
        def compile(self, rate):
            super().compile(optimizer=keras.optimizers.SGD(rate), loss="mse")

    seen = []

    def note_frame():
        frame = compiled_elsewhere._keras_compile_frame()
        if frame is not None and frame.f_locals.get("self") is model:
            outermost, keras_own = compiled_elsewhere._outermost_compile(frame, model)
            seen.append((compiled_elsewhere._call_arguments(outermost), keras_own))

    with canary("keras.src.trainers.trainer.Trainer.compile, creating variables in its frame",
                "keras_dist.compiled_elsewhere distributes models compiled without keras_dist.compile"):
        model = Subclass([keras.Input((2,)), keras.layers.Dense(1)])
        if keras.backend.backend() == "jax":
            watch = compiled_elsewhere.CompiledElsewhereWatch(None)
            watch.get_variable_layout = lambda variable: note_frame()
            keras.distribution.set_distribution(watch)
            try:
                model.compile(0.1)
            finally:
                keras.distribution.set_distribution(None)
        elif keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            def creator(next_creator, **kwargs):
                note_frame()
                return next_creator(**kwargs)

            with tf.variable_creator_scope(creator):
                model.compile(0.1)
        else:
            pytest.skip("PyTorch calls nothing of keras_dist's while Keras compiles")
        # The outermost compile of the model on the stack is the subclass's, with its own arguments.
        assert seen and seen[-1] == (((), {"rate": 0.1}), False), seen


def test_data_adapter_class():
    with canary("keras.src.trainers.data_adapters.data_adapter.DataAdapter",
                "keras_dist.inputs.arrays.EpochBatches is one, which fit must take as it is"):
        adapter_class = keras_internals.data_adapter_class()
        adapter = type("Batches", (adapter_class,), {"num_batches": 1})()
        assert keras_internals.get_data_adapter(adapter) is adapter


def test_packed_arrays():
    with canary("keras.src.trainers.data_adapters.array_data_adapter.ArrayDataAdapter._inputs",
                "keras_dist.inputs.arrays.EpochRows packs fit's arrays as Keras's array adapter does"):
        x, labels = np.zeros((4, 2), "float32"), np.array([0, 1, 1, 0])
        assert keras_internals.packed_arrays(x) is x
        assert isinstance(keras_internals.packed_arrays([x, x]), tuple)
        weights = np.arange(4.0)
        packed = keras_internals.packed_arrays(x, [labels, labels], weights)
        assert packed[2][0] is weights and packed[2][1] is weights
        _, _, from_classes = keras_internals.packed_arrays(x, labels, class_weight={0: 1.0, 1: 3.0})
        assert np.asarray(from_classes).tolist() == [1.0, 3.0, 3.0, 1.0]


# --- array slicing -----------------------------------------------------------------------------

ARRAY_SLICING = "keras.src.trainers.data_adapters.array_slicing"


def test_can_slice_array():
    with canary(f"{ARRAY_SLICING}.can_slice_array", "keras_dist.inputs.arrays tells arrays from other inputs with it"):
        assert keras_internals.can_slice_array(np.zeros(3))
        assert not keras_internals.can_slice_array(iter([1, 2]))


def test_convert_to_sliceable():
    with canary(f"{ARRAY_SLICING}.convert_to_sliceable", "keras_dist.inputs.arrays cuts shares with it"):
        data = {"a": np.arange(6), "b": [np.arange(6) * 10, None]}
        sliceable = keras_internals.convert_to_sliceable(data)
        rows = np.array([1, 4])
        cut = keras.tree.map_structure(lambda s: None if s is None else s[rows], sliceable)
        assert np.asarray(cut["a"]).tolist() == [1, 4] and np.asarray(cut["b"][0]).tolist() == [10, 40]
        assert cut["b"][1] is None
        for_tf = keras_internals.convert_to_sliceable(data, target_backend="tensorflow")
        assert np.asarray(for_tf["a"]).tolist() == list(range(6))


def test_take_batch():
    with canary(f"{ARRAY_SLICING} Sliceable conversions",
                "keras_dist.inputs.arrays.EpochRows converts each batch as Keras's array adapter does"):
        rows = np.array([3, 1])
        (sliceable,) = keras_internals.convert_to_sliceable([np.arange(8, dtype="float64").reshape(4, 2)])
        for target in ("numpy", "jax", "torch", "tensorflow"):
            batch = keras_internals.take_batch(sliceable, rows, target)
            assert np.asarray(batch).tolist() == [[6.0, 7.0], [2.0, 3.0]] and batch.dtype == "float32", target
        pandas = pytest.importorskip("pandas")
        (series,) = keras_internals.convert_to_sliceable([pandas.Series(np.arange(4.0))])
        assert keras_internals.take_batch(series, rows, "numpy").shape == (2, 1)
        scipy_sparse = pytest.importorskip("scipy.sparse")
        tf = pytest.importorskip("tensorflow")
        (sparse,) = keras_internals.convert_to_sliceable([scipy_sparse.csr_matrix(np.eye(4, dtype="float32"))])
        batch = keras_internals.take_batch(sparse, rows, "tensorflow")
        assert isinstance(batch, tf.SparseTensor) and tf.sparse.to_dense(batch).numpy().tolist()[0] == [0, 0, 0, 1]


def test_gather_batch():
    tf = pytest.importorskip("tensorflow")
    with canary(f"{ARRAY_SLICING}.TensorflowSparseWrapper and slice_tensorflow_sparse_wrapper",
                "keras_dist.inputs.arrays.EpochBatches gathers each batch in tf.data as Keras's array adapter does"):
        data = (np.arange(8, dtype="float32").reshape(4, 2), tf.sparse.from_dense(np.eye(4, dtype="float32")))
        arrays = keras_internals.convert_to_sliceable(data, target_backend="tensorflow")
        indices = tf.data.Dataset.from_tensors(tf.constant([3, 1], tf.int64))
        dense, sparse = next(iter(tf.data.Dataset.zip((indices, tf.data.Dataset.from_tensors(arrays)))
                                  .map(keras_internals.gather_batch)))
        assert dense.numpy().tolist() == [[6.0, 7.0], [2.0, 3.0]]
        assert tf.sparse.to_dense(sparse).numpy().tolist() == [[0, 0, 0, 1], [0, 1, 0, 0]]


def test_train_validation_split():
    with canary(f"{ARRAY_SLICING}.train_validation_split",
                "keras_dist.inputs.arrays.hold_out applies Keras's validation_split with it"):
        kept, held = keras_internals.train_validation_split((np.arange(10), np.arange(10) * 2), validation_split=0.2)
        assert np.asarray(kept[0]).tolist() == list(range(8)) and np.asarray(held[1]).tolist() == [16, 18]


# --- variables ---------------------------------------------------------------------------------


def test_variable_value():
    with canary("keras.src.backend.common.variables.Variable._value",
                "keras_dist moves (tf_strategy), shards (keras_workarounds) and places (jax_data_parallel) it"):
        value = keras_internals.variable_value(keras.Variable(np.ones(2, "float32")))
        module, native = {"tensorflow": ("tensorflow", "Variable"), "jax": ("jax", "Array"),
                          "torch": ("torch", "Tensor")}[keras.backend.backend()]
        assert isinstance(value, getattr(sys.modules[module], native)), type(value)
        assert keras_internals.variable_value(object()) is None
        from keras.src.backend.common.stateless_scope import StatelessScope

        with StatelessScope():  # what tf_strategy.move_variables leaves for Keras to make later
            assert keras_internals.variable_value(keras.Variable(keras.initializers.Zeros(), shape=(2,))) is None


def _deferred_pair():
    """Two variables made in a stateless scope that leaves them uninitialized, taken off Keras's list."""
    before = len(keras_internals.deferred_variables())
    with keras.StatelessScope(initialize_variables=False):
        kernel = keras.Variable(keras.initializers.Constant(2.0), shape=(2,))
        bias = keras.Variable(keras.initializers.Zeros(), shape=(3,))
    pending = keras_internals.deferred_variables()
    made = pending[before:]
    del pending[before:]
    return made, kernel, bias


def test_made_without_values():
    with canary("keras.src.backend.common.global_state 'uninitialized_variables'",
                "keras_dist.split_weights takes the variables built inside it off Keras's list"):
        before = list(keras_internals.deferred_variables())
        with keras_internals.made_without_values() as made:
            kernel = keras.Variable(keras.initializers.Constant(2.0), shape=(2,))
        assert made == [kernel] and keras_internals.variable_value(kernel) is None
        assert keras_internals.deferred_variables() == before


def test_deferred_variables():
    with canary("keras.src.backend.common.global_state 'uninitialized_variables'",
                "keras_dist.split_weights finds the variables built inside it there"):
        made, kernel, bias = _deferred_pair()
        assert made == [kernel, bias] and keras_internals.variable_value(kernel) is None


def test_take_initializer():
    with canary("keras.src.backend.common.variables.Variable._initializer",
                "keras_dist.split_weights makes each variable's value from it, then keeps a slice"):
        _, kernel, _ = _deferred_pair()
        initializer = keras_internals.take_initializer(kernel)
        assert keras.ops.convert_to_numpy(initializer((2,), dtype="float32")).tolist() == [2.0, 2.0]


def test_initialize_deferred():
    with canary("keras.src.backend.common.variables.Variable._deferred_initialize",
                "keras_dist.split_weights initializes the variables it does not split with it"):
        _, _, bias = _deferred_pair()
        keras_internals.initialize_deferred(bias)
        assert keras.ops.convert_to_numpy(bias).tolist() == [0.0, 0.0, 0.0]


def test_initialize_variable():
    with canary("keras.src.backend.common.variables.Variable._initialize and _trainable",
                "keras_dist.strategies.tf_strategy.move_variables and keras_workarounds.layer_state_aggregated "
                "make a variable's backend value anew with it"):
        variable = keras.Variable(np.ones(2, "float32"))
        keras_internals.initialize_variable(variable, keras.ops.convert_to_tensor(np.full(2, 3.0, "float32")))
        assert keras.ops.convert_to_numpy(variable).tolist() == [3.0, 3.0]
        keras_internals.initialize_variable(variable, keras.ops.convert_to_tensor(np.ones(2, "float32")),
                                            trainable=False)
        assert variable.trainable is True
        value = keras_internals.variable_value(variable)
        if keras.backend.backend() == "tensorflow":
            assert value.trainable is False
        elif keras.backend.backend() == "torch":
            assert value.requires_grad is False


def test_set_variable_aggregation():
    with canary("keras.src.backend.common.variables.Variable._aggregation",
                "keras_dist.keras_workarounds.layer_state_aggregated makes layer state averaged under "
                "CentralStorageStrategy"):
        variable = keras.Variable(np.zeros(2, "float32"), aggregation="none")
        keras_internals.set_variable_aggregation(variable, "mean")
        assert variable.aggregation == "mean"
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            keras_internals.initialize_variable(variable, tf.zeros(2))
            assert keras_internals.variable_value(variable).aggregation == tf.VariableAggregation.MEAN


def data_parallel():
    return keras.distribution.DataParallel(devices=keras.distribution.list_devices())


def test_jax_sharding():
    only_under("jax")
    import jax

    with canary("keras.src.backend.jax.core.Variable._layout and _initialize_layout",
                "keras_dist.strategies.jax_data_parallel places variables by their layout without a collective"):
        variable = keras.Variable(np.ones((2, 3), "float32"))
        assert keras_internals.jax_sharding(variable) is None  # no distribution
        with data_parallel().scope():
            sharding = keras_internals.jax_sharding(variable)  # asked of the distribution
        assert isinstance(sharding, jax.sharding.NamedSharding) and sharding.is_fully_replicated
        assert keras_internals.jax_sharding(variable) == sharding  # kept


def test_set_jax_value():
    only_under("jax")
    import jax

    with canary("keras.src.backend.jax.core.Variable._value",
                "keras_dist.strategies.jax_data_parallel sets each variable's array as it placed it"):
        variable, array = keras.Variable(np.zeros(2, "float32")), jax.numpy.ones(2)
        keras_internals.set_jax_value(variable, array)
        assert variable.value is array and keras.ops.convert_to_numpy(variable).tolist() == [1.0, 1.0]


def test_drop_jax_layout():
    only_under("jax")
    with canary("keras.src.backend.jax.core.Variable._layout",
                "keras_dist.strategies.jax_data_parallel keeps variables on one process's devices without it"):
        with data_parallel().scope():
            variable = keras.Variable(np.ones((2, 3), "float32"))  # made with the distribution's layout
        assert keras_internals.jax_sharding(variable) is not None
        keras_internals.drop_jax_layout(variable)
        assert keras_internals.jax_sharding(variable) is None


def test_set_jax_layout():
    only_under("jax")
    import jax

    with canary("keras.src.backend.jax.core.Variable._layout",
                "keras_dist.strategies.jax_data_parallel splits weights over the mesh by their layout"):
        distribution = data_parallel()
        variable = keras.Variable(np.ones((2, 3), "float32"))
        layout = keras.distribution.TensorLayout([None, None], distribution.device_mesh)
        keras_internals.set_jax_layout(variable, layout)
        with distribution.scope():
            sharding = keras_internals.jax_sharding(variable)  # the layout given, not asked again
        assert isinstance(sharding, jax.sharding.NamedSharding) and sharding == layout.backend_layout


# --- layers and epoch iterators ----------------------------------------------------------------


def test_seed_generators():
    with canary("keras.src.layers.Layer._seed_generators",
                "keras_dist's resume saves and restores the state of every layer's seed generators"):
        dropout = keras.layers.Dropout(0.5, seed=1)
        (generator,) = keras_internals.seed_generators(dropout)
        assert generator is dropout.seed_generator and isinstance(generator.state, keras.Variable)
        assert keras_internals.seed_generators(keras.layers.Dense(1)) == []


def test_embeddings_variable():
    with canary("keras.src.layers.Embedding._embeddings",
                "keras_dist.strategies.parameter_server.sharded_variables looks up a sharded table's rows by shard"):
        layer = keras.layers.Embedding(5, 2)
        layer.build((None,))
        table = keras_internals.embeddings_variable(layer)
        assert table is layer.embeddings and tuple(table.shape) == (5, 2)  # no LoRA: the public one is it


def test_batch_enumerator():
    with canary("keras.src.trainers.epoch_iterator.EpochIterator._enumerate_iterator",
                "keras_dist.fault_tolerance.resume starts a resumed epoch at its next step by replacing it"):
        from keras.src.trainers.epoch_iterator import EpochIterator

        epoch_iterator = EpochIterator(x=np.arange(6.0).reshape(6, 1), batch_size=2, shuffle=False)
        keras_enumerate = keras_internals.batch_enumerator(epoch_iterator)

        def from_step_1():
            for begin, end, batches in keras_enumerate():
                if begin < 1:
                    next(batches)
                    continue
                yield begin, end, batches

        override(epoch_iterator, "_enumerate_iterator", from_step_1)
        for _ in range(2):  # each epoch
            firsts = [(begin, float(np.asarray(batch[0][0]).ravel()[0])) for begin, _, batch in epoch_iterator]
            assert firsts == [(1, 2.0), (2, 4.0)]


# --- saving ------------------------------------------------------------------------------------


def tiny_model():
    return keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])


def test_h5_io_store(tmp_path):
    from keras_dist.fault_tolerance.background_writes import WeightsSnapshot

    with canary("keras.src.saving.saving_lib.H5IOStore",
                "keras_dist.fault_tolerance.background_writes.WeightsSnapshot copies and writes backups through it"):
        model, other = tiny_model(), tiny_model()
        snapshot = WeightsSnapshot()
        snapshot.take(model)
        snapshot.write(str(tmp_path / "copy.weights.h5"))
        other.load_weights(str(tmp_path / "copy.weights.h5"))
        for mine, theirs in zip(model.get_weights(), other.get_weights()):
            np.testing.assert_array_equal(mine, theirs)


def test_save_state():
    with canary("keras.src.saving.saving_lib._save_state",
                "keras_dist.fault_tolerance.background_writes.WeightsSnapshot walks the model's saved state with it"):
        seen = {}

        class Recorder(keras_internals.h5_io_store()):
            def __init__(self):
                self.mode = "w"

            def __bool__(self):
                return True

            def make(self, path, metadata=None):
                self.path = path
                return self

            def __setitem__(self, key, value):
                seen[f"{self.path}/{key}"] = np.asarray(value)

        model = tiny_model()
        keras_internals.save_state(model, Recorder())
        assert sorted(v.shape for v in seen.values()) == sorted(w.shape for w in model.get_weights()), sorted(seen)


# --- BackupAndRestore's files and position -----------------------------------------------------


def fitted_backup(tmp_path, epochs=1, **options):
    """A `BackupAndRestore` (its files kept) and its model after `epochs` of a tiny fit."""
    model = tiny_model()
    model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), delete_checkpoint=False, **options)
    if epochs:
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=epochs, verbose=0, callbacks=[backup])
    else:
        backup.set_model(model)
    return model, backup


def test_backup_files(tmp_path):
    with canary("keras.src.callbacks.BackupAndRestore._weights_path and _training_metadata_path",
                "keras_dist.fault_tolerance.atomic_writes commits backups under them; resume reads the position there"):
        _, backup = fitted_backup(tmp_path)
        weights, metadata = keras_internals.backup_files(backup)
        assert weights.endswith(".weights.h5") and os.path.exists(weights) and os.path.exists(metadata)


def test_set_backup_files(tmp_path):
    with canary("keras.src.callbacks.BackupAndRestore._weights_path and _training_metadata_path",
                "keras_dist.fault_tolerance.atomic_writes points a save at partial files with them"):
        model, backup = fitted_backup(tmp_path, epochs=0)
        partials = str(tmp_path / "partial.weights.h5"), str(tmp_path / "partial.json")
        keras_internals.set_backup_files(backup, *partials)
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0, callbacks=[backup])
        assert all(os.path.exists(path) for path in partials)


def test_previous_backup_files(tmp_path):
    with canary("keras.src.callbacks.BackupAndRestore._prev_weights_path and _prev_training_metadata_path",
                "keras_dist.fault_tolerance.atomic_writes writes them first in its commit (double_checkpoint)"):
        _, backup = fitted_backup(tmp_path, epochs=2, double_checkpoint=True)
        previous = keras_internals.previous_backup_files(backup)
        assert len(previous) == 2 and all(os.path.exists(path) for path in previous)


def saved_position(tmp_path, epoch, batch):
    _, backup = fitted_backup(tmp_path, epochs=0)
    keras_internals.set_backup_position(backup, epoch, batch)
    keras_internals.save_backup(backup)
    with open(keras_internals.backup_files(backup)[1]) as f:
        return json.load(f)


def test_set_backup_position(tmp_path):
    with canary("keras.src.callbacks.BackupAndRestore._current_epoch and _last_batch_seen",
                "keras_dist.fault_tolerance.resume records a save's place inside an epoch in them"):
        assert saved_position(tmp_path, 3, 5) == {"epoch": 3, "batch": 5}


def test_save_backup(tmp_path):
    with canary("keras.src.callbacks.BackupAndRestore._save_model",
                "keras_dist.fault_tolerance.resume saves at the step every process agreed on with it"):
        assert saved_position(tmp_path, 0, 2) == {"epoch": 0, "batch": 2}


def test_initial_epoch(tmp_path):
    with canary("keras.src.models.Model._initial_epoch (set by BackupAndRestore)",
                "keras_dist's resume, the parameter-server loop and SyncInitialState read where fit starts in it"):
        fitted_backup(tmp_path, epochs=2)
        model, _ = fitted_backup(tmp_path, epochs=3)  # a rerun: the backup restores epoch 2
        assert keras_internals.initial_epoch(model) == 2


def test_set_initial_epoch():
    with canary("keras.src.models.Model._initial_epoch",
                "keras_dist's resume and SyncInitialState tell fit where to start with it"):
        model = tiny_model()
        model.compile(optimizer="sgd", loss="mse")

        class StartAt(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                keras_internals.set_initial_epoch(self.model, 2)

        history = model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=3, verbose=0, callbacks=[StartAt()])
        assert history.epoch == [2]


def test_flatten_layers():
    with canary("keras.src.layers.Layer._flatten_layers",
                "keras_dist's resume (seed generators) and sharded embeddings walk a model's layers with it"):
        inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2), keras.layers.Dropout(0.5)])
        outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
        kinds = [type(layer).__name__ for layer in keras_internals.flatten_layers(outer)]
        assert kinds.count("Dense") == 2 and "Dropout" in kinds


def test_sublayers():
    with canary("keras.src.layers.Layer._flatten_layers(include_self=False, recursive=False)",
                "keras_dist's split weights (shard='weights' on PyTorch) walk the layers to find who reads each variable"):
        inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        outer = keras.Sequential([keras.Input((3,)), inner, keras.layers.Dense(1)])
        found = [id(layer) for layer in keras_internals.sublayers(outer)]
        assert id(inner) in found and id(outer.layers[1]) in found and id(inner.layers[0]) not in found


def test_own_trainable_variables():
    with canary("keras.src.layers.Layer._trainable_variables",
                "keras_dist's split weights (shard='weights' on PyTorch) gather a layer's own variables for its call"):
        inner = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        dense = inner.layers[0]
        assert [id(v) for v in keras_internals.own_trainable_variables(dense)] == [id(dense.kernel), id(dense.bias)]
        assert keras_internals.own_trainable_variables(inner) == []


def test_save_method(tmp_path):
    with canary("keras.src.callbacks.ModelCheckpoint._save_model and BackupAndRestore._save_model",
                "keras_dist.fault_tolerance.atomic_writes and the JAX strategy's chief wrap them"):
        model = compiled_model()
        checkpoint = keras.callbacks.ModelCheckpoint(str(tmp_path / "model.keras"))
        keras_save = keras_internals.save_method(checkpoint)
        saves = []
        override(checkpoint, "_save_model", lambda epoch, batch, logs: saves.append((epoch, batch))
                 or keras_save(epoch, batch, logs))
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=2, verbose=0, callbacks=[checkpoint])
        assert saves == [(0, None), (1, None)] and os.path.exists(tmp_path / "model.keras")
        _, backup = fitted_backup(tmp_path, epochs=0)
        keras_save = keras_internals.save_method(backup)
        override(backup, "_save_model", lambda: saves.append("backup") or keras_save())
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0, callbacks=[backup])
        assert saves[2:] == ["backup"] and all(os.path.exists(path) for path in keras_internals.backup_files(backup))


def test_save_schedule(tmp_path):
    with canary("keras.src.callbacks.ModelCheckpoint's and BackupAndRestore's save counters (_batches_seen_since_last_saving, "
                "_last_batch_seen, _current_epoch, best)",
                "keras_dist.callbacks.file_callbacks gives each fit's new stand-in the chief's"):
        model = compiled_model()
        x, y = np.ones((8, 3)), np.ones((8, 2))
        steps = keras.callbacks.LambdaCallback(on_train_batch_end=lambda batch, logs: steps.__setattr__("n", steps.n + 1))
        steps.n = 0
        for make in (lambda name: keras.callbacks.ModelCheckpoint(str(tmp_path / f"{name}.keras"), save_freq=3),
                     lambda name: keras.callbacks.BackupAndRestore(str(tmp_path / name), save_freq=3)):
            saves = {}
            kept, fresh = make("kept"), make("fresh")
            for callback in (kept, fresh):
                keras_save = keras_internals.save_method(callback)
                override(callback, "_save_model", lambda *a, _c=callback, _s=keras_save, **k:
                         saves.setdefault(id(_c), []).append(steps.n) or _s(*a, **k))
            steps.n = 0
            model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[steps, kept])  # 4 steps: saved after the third
            for name, value in keras_internals.save_schedule(kept).items():
                setattr(fresh, name, value)
            model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[steps, kept, fresh])
            assert saves[id(kept)] == [3, 6] and saves[id(fresh)] == [6], (type(kept).__name__, saves)


def test_callback_model():
    with canary("keras.src.callbacks.Callback._model",
                "keras_dist.fault_tolerance.scratch copies a callback, not its model, with it"):
        callback, model = keras.callbacks.Callback(), tiny_model()
        assert keras_internals.callback_model(callback) is None
        callback.set_model(model)
        assert keras_internals.callback_model(callback) is model


def test_tensorboard_step_counter(tmp_path):
    pytest.importorskip("tensorflow")
    with canary("keras.src.callbacks.TensorBoard._global_train_batch",
                "keras_dist's resume carries TensorBoard's batch step over a restart"):
        counter = keras_internals.tensorboard_step_counter()
        tensorboard = keras.callbacks.TensorBoard(str(tmp_path), update_freq=1)

        class ResumeAt10(keras.callbacks.Callback):  # after TensorBoard's own on_train_begin, as keras_dist's resume
            def on_train_begin(self, logs=None):
                setattr(tensorboard, counter, 10)

        model = compiled_model()
        model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=2, verbose=0,
                  callbacks=[tensorboard, ResumeAt10()])
        assert getattr(tensorboard, counter) == 14


# --- random seeds ------------------------------------------------------------------------------


@pytest.fixture
def keras_seed_state(monkeypatch):
    """Keras's global seed and seed generator as they were; Python's, NumPy's and the frameworks' left alone."""
    from keras.src.backend.common import global_state

    names = ("global_random_seed", "global_seed_generator")
    before = [global_state.get_global_attribute(name) for name in names]
    import random

    monkeypatch.setattr(random, "seed", lambda seed: None)
    monkeypatch.setattr(np.random, "seed", lambda seed: None)
    if "tensorflow" in sys.modules:
        monkeypatch.setattr(sys.modules["tensorflow"].random, "set_seed", lambda seed: None)
    if "torch" in sys.modules:
        monkeypatch.setattr(sys.modules["torch"], "manual_seed", lambda seed: None)
    yield
    for name, value in zip(names, before):
        global_state.set_global_attribute(name, value)


def test_get_random_seed(keras_seed_state):
    with canary("keras.src.utils.rng_utils.get_random_seed",
                "keras_dist.inputs.job_seed and keras_dist.startup read the script's keras.utils.set_random_seed"):
        keras.utils.set_random_seed(1234)
        assert keras_internals.get_random_seed() == 1234


def test_set_global_random_seed(keras_seed_state):
    with canary("keras.src.utils.rng_utils.GLOBAL_RANDOM_SEED and keras.src.random.seed_generator's global generator",
                "keras_dist.startup.share_random_seed gives every process the chief's seed through them"):
        from keras.src.random.seed_generator import global_seed_generator

        used = global_seed_generator()
        keras_internals.set_global_random_seed(77)
        assert keras_internals.get_random_seed() == 77
        # A new generator, seeded anew from Python's `random` (which startup seeds next).
        assert global_seed_generator() is not used


# --- utilities ---------------------------------------------------------------------------------


def test_is_default():
    with canary("keras.src.utils.python_utils.is_default",
                "keras_dist.callbacks.batch_logs tells which callbacks read per-batch logs with it"):
        class Reads(keras.callbacks.Callback):
            def on_train_batch_end(self, batch, logs=None):
                pass

        assert keras_internals.is_default(keras.callbacks.Callback().on_train_batch_end)
        assert not keras_internals.is_default(Reads().on_train_batch_end)


def test_print_msg(capsys):
    with canary("keras.src.utils.io_utils.print_msg",
                "keras_dist.callbacks.LearningRateWarmup prints its message with it"):
        keras_internals.print_msg("warmup done")
        if keras.config.is_interactive_logging_enabled():
            assert capsys.readouterr().out == "warmup done\n"


# --- private methods replaced by name on one object (`keras_dist.overrides`) -------------------
# Those without a `keras_internals` function of their own: the replacement takes the arguments
# Keras calls them with, so the canary checks that Keras still has the method and calls it so.
# tests/test_house.py fails on a private name in keras_dist that no canary here names.


def test_should_save_on_batch(tmp_path):
    with canary("keras.src.callbacks.backup_and_restore.BackupAndRestore._should_save_on_batch",
                "keras_dist.fault_tolerance.resume decides when a backup is due by replacing it"):
        model, backup = compiled_model(), keras.callbacks.BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
        asked = []
        override(backup, "_should_save_on_batch", lambda batch: asked.append(batch) or False)
        model.fit(np.ones((4, 3)), np.ones((4, 2)), batch_size=2, epochs=1, verbose=0, callbacks=[backup])
        assert asked == [0, 1]


def test_get_metrics_result_or_logs():
    with canary("keras.src.trainers.trainer.Trainer._get_metrics_result_or_logs",
                "keras_dist.training gives Keras's loops the metrics of every process by replacing it"):
        model = compiled_model(metrics=["mae"])
        asked = []
        keras_result = model._get_metrics_result_or_logs
        override(model, "_get_metrics_result_or_logs", lambda logs: asked.append(logs) or keras_result(logs))
        logs = model.evaluate(np.ones((4, 3)), np.ones((4, 2)), verbose=0, return_dict=True)
        assert asked and set(logs) == {"loss", "mae"}


def test_symbolic_build_takes_the_epoch_iterator():
    # TensorFlow's fit asks `_maybe_symbolic_build`, the others' `_symbolic_build`.
    name = "_maybe_symbolic_build" if keras.backend.backend() == "tensorflow" else "_symbolic_build"
    with canary(f"keras's Trainer.{name}", "keras_dist's tf.distribute models (keras_workarounds) and a resumed fit "
                "(keras_dist.fault_tolerance.resume, which takes the epoch iterator) replace it"):
        model = compiled_model()
        called = []
        keras_build = getattr(model, name)
        override(model, name, lambda iterator=None, data_batch=None: called.append(iterator)
                 or keras_build(iterator=iterator))
        model.fit(np.ones((4, 3)), np.ones((4, 2)), epochs=1, verbose=0)
        assert len(called) == 1 and called[0] is not None


def test_loaded_get_file_code(tmp_path):
    """`keras.utils.get_file` first makes its cache directory (its local `datadir`), where
    `keras_dist.downloads` sees it from a Python audit hook."""
    from keras_dist import downloads

    source = tmp_path / "data.txt"
    source.write_text("one line")
    (tmp_path / "cache").mkdir()  # else get_file falls back to /tmp/.keras
    seen, listening = [], [True]

    def hook(event, args):
        if listening and event == "os.mkdir":
            seen.append(downloads._get_file_making_its_directory(os.fsdecode(args[0])) is not None)

    sys.addaudithook(hook)  # cannot be removed: `listening` turns it off
    with canary("keras.src.utils.file_utils.get_file, its makedirs(datadir)",
                "keras_dist.downloads runs get_file once per machine"):
        try:
            path = keras.utils.get_file(origin=source.as_uri(), cache_dir=tmp_path / "cache")
        finally:
            listening.clear()
        assert open(path).read() == "one line"
        assert seen.count(True) == 1, seen


def test_checkpoint_save_counter_and_write(tmp_path):
    """TensorFlow (not Keras): a `tf.train.Checkpoint` creates its save counter, a variable, in
    `_maybe_create_save_counter` at its first save, and `save`, `write` and
    `CheckpointManager.save` all write through the object's `"_write"`, which
    `keras_dist.fault_tolerance.tf_checkpoints` replaces on that one checkpoint."""
    tf = pytest.importorskip("tensorflow")
    from keras_dist.fault_tolerance import tf_checkpoints

    checkpoint, seen, written = tf.train.Checkpoint(step=tf.Variable(1)), [], []

    def creator(next_creator, **kwargs):
        seen.append(tf_checkpoints._checkpoint_creating_its_save_counter())
        return next_creator(**kwargs)

    with canary("tensorflow.python.checkpoint.checkpoint.Checkpoint._maybe_create_save_counter and _write",
                "keras_dist.fault_tolerance.tf_checkpoints writes the script's tf.train checkpoints once"):
        tensorflow_write = checkpoint._write
        override(checkpoint, "_write", lambda prefix, options=None: written.append(prefix) or
                 tensorflow_write(prefix, options=options))
        with tf.variable_creator_scope(creator):
            tf.train.CheckpointManager(checkpoint, tmp_path / "managed", max_to_keep=1).save()
        checkpoint.save(tmp_path / "saved")
        checkpoint.write(tmp_path / "written")
        assert seen == [checkpoint]
        assert [os.path.basename(str(p)) for p in written] == ["ckpt-1", "saved-2", "written"], written
