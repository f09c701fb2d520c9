"""Variables split into shards (the parameter_server backend's variable partitioner).

These run in one process: a `ShardedVariable` is built by hand from the model's own
values, as ParameterServerStrategy builds one from a partitioner's split. Training
over a real cluster of ps tasks is in test_parameter_server.py.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python.distribute.sharded_variable import ShardedVariable

from keras_dist import keras_workarounds
from keras_dist.strategies.parameter_server import sharded_variables
from keras_dist.errors import KerasDistError

ROWS, DIM = 50, 4


def make_model(seed=0, model_class=keras.Model):
    keras.utils.set_random_seed(seed)
    ids = keras.Input((3,), dtype="int32")
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(ROWS, DIM, name="table")(ids))
    hidden = keras.layers.Dense(6, activation="tanh", name="hidden")(pooled)
    return model_class(ids, keras.layers.Dense(1, name="out")(hidden))


def split(variable, parts):
    """Backs a Keras variable by a ShardedVariable of `parts` row blocks, values kept."""
    blocks = np.array_split(variable.numpy(), parts)
    variable._value = ShardedVariable([tf.Variable(b, name=f"{variable.name}/part_{i}") for i, b in enumerate(blocks)])


def data(steps, batch=8, seed=1):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ROWS, size=(steps, batch, 3)).astype("int32")
    return ids, rng.normal(size=(steps, batch, 1)).astype("float32")


def train(model, step, steps=6):
    run = tf.function(step)
    ids, targets = data(steps)
    logs = [run((ids[i], targets[i])) for i in range(steps)]
    return [float(log["loss"]) for log in logs]


def sharded_model(optimizer, parts=(3, 2), model_class=keras.Model):
    model = make_model(model_class=model_class)
    split(model.get_layer("table").embeddings, parts[0])  # sparse gradients (row slices)
    split(model.get_layer("hidden").kernel, parts[1])  # dense gradients
    keras_workarounds.sharded_variable_updates(optimizer)
    model.compile(optimizer=optimizer, loss="mse", metrics=["mae"])
    model.optimizer.build(model.trainable_variables)
    return model


@pytest.mark.parametrize("make_optimizer", [lambda: keras.optimizers.SGD(0.1, momentum=0.9),
                                            lambda: keras.optimizers.Adam(0.01)])
def test_training_sharded_variables_matches_training_whole_ones(make_optimizer):
    whole = make_model()
    initial_table = whole.get_layer("table").embeddings.numpy()
    whole.compile(optimizer=make_optimizer(), loss="mse", metrics=["mae"])
    sharded = sharded_model(make_optimizer())
    sharded_variables.embedding_lookups_by_shard(sharded)
    expected = train(whole, whole.train_step)
    losses = train(sharded, keras_workarounds.train_step_over_shards(sharded))
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert not np.allclose(sharded.get_layer("table").embeddings.numpy(), initial_table, atol=1e-3)
    for got, want in zip(sharded.get_weights(), whole.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # Slots (momentum; Adam's moments) were made for the sharded variables too, and updated alike.
    for got, want in zip(sharded.optimizer.variables, whole.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)


def test_sharded_embedding_reads_only_its_batch_rows_and_gives_the_same_outputs():
    model = make_model()
    ids = data(1)[0][0]
    ids[0, 0] = -1  # the last row, as in Keras's lookup
    expected = model(ids).numpy()
    split(model.get_layer("table").embeddings, 3)
    sharded_variables.embedding_lookups_by_shard(model)
    assert "_lookup_by_shard" in model.get_layer("table").call.__qualname__
    np.testing.assert_allclose(model(ids).numpy(), expected, rtol=1e-6)
    ids[0, 0] = 0
    shards = model.get_layer("table").embeddings._value.variables
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(model(ids[:1]))
    gradients = tape.gradient(loss, shards)
    # Row slices of the three ids in the batch's first example, nothing dense.
    assert all(isinstance(g, tf.IndexedSlices) for g in gradients)
    assert sum(int(tf.shape(g.indices)[0]) for g in gradients) == 3


def test_sharded_weights_save_and_load(tmp_path):
    model = sharded_model(keras.optimizers.Adam(0.01))
    keras_workarounds.sharded_variables_savable(model.variables + model.optimizer.variables)
    path = str(tmp_path / "model.weights.h5")
    model.save_weights(path)
    fresh = make_model(seed=5)
    fresh.load_weights(path)
    for got, want in zip(fresh.get_weights(), model.get_weights()):
        np.testing.assert_array_equal(got, want)
    other = make_model(seed=5)
    other.save_weights(path)
    model.load_weights(path)  # other values, assigned shard by shard
    np.testing.assert_array_equal(model.get_layer("table").embeddings.numpy(), other.get_layer("table").embeddings.numpy())
    assert not np.array_equal(other.get_layer("table").embeddings.numpy(), fresh.get_layer("table").embeddings.numpy())


class ScaledEmbedding(keras.layers.Embedding):
    def call(self, inputs):
        return super().call(inputs) * 2.0


def test_embedding_subclasses_and_sparse_ids_keep_keras_lookup():
    ids = keras.Input((3,), dtype="int32")
    model = keras.Model(ids, ScaledEmbedding(ROWS, DIM)(ids))
    batch = data(1)[0][0]
    expected = model(batch).numpy()
    split(model.layers[1].embeddings, 2)
    sharded_variables.embedding_lookups_by_shard(model)
    np.testing.assert_allclose(model(batch).numpy(), expected, rtol=1e-6)
    layer = make_model().get_layer("table")
    sparse = tf.SparseTensor([[0, 0], [1, 2]], [3, 7], [2, 3])
    expected = layer(sparse).numpy()
    split(layer.embeddings, 2)
    object.__setattr__(layer, "call", sharded_variables._lookup_by_shard(layer))
    np.testing.assert_allclose(layer(sparse).numpy(), expected, rtol=1e-6)


class CustomStep(keras.Model):
    def train_step(self, data):
        return super().train_step(data)


def test_sharded_variables_refuse_custom_train_steps_and_weight_decay_in_one_line():
    model = sharded_model(keras.optimizers.SGD(0.1), model_class=CustomStep)
    with pytest.raises(KerasDistError, match="CustomStep overrides train_step") as error:
        sharded_variables.train_step(model)
    assert "\n" not in str(error.value)
    with pytest.raises(KerasDistError, match="drop weight_decay"):
        sharded_variables.train_step(sharded_model(keras.optimizers.AdamW(0.01, weight_decay=0.01)))
    with pytest.raises(KerasDistError, match="drop use_ema"):
        sharded_variables.train_step(sharded_model(keras.optimizers.SGD(0.1, use_ema=True)))
    assert sharded_variables.train_step(sharded_model(keras.optimizers.SGD(0.1))) is not None
    # A frozen sharded table needs no gradient: Keras's own (custom) step is kept.
    frozen = sharded_model(keras.optimizers.SGD(0.1), model_class=CustomStep)
    frozen.get_layer("table").trainable = False
    frozen.get_layer("hidden").trainable = False
    assert sharded_variables.train_step(frozen) == frozen.train_step


def test_bad_shard_size_and_run_eagerly_are_refused_in_one_line():
    from keras_dist.settings import Settings
    from keras_dist.strategies.parameter_server.strategy import ParameterServerStrategy, _partitioner_from_settings

    for text in ("0", "64k", "²"):
        with pytest.raises(KerasDistError, match="KERAS_DIST_MIN_SHARD_BYTES='.*' is not a number of at least 1"):
            Settings.from_environ({"KERAS_DIST_MIN_SHARD_BYTES": text})
    chosen = Settings.from_environ({"KERAS_DIST_MIN_SHARD_BYTES": "1024"})
    assert _partitioner_from_settings(2, chosen)(tf.TensorShape([1000, 8]), tf.float32) == [2, 1]
    model = make_model()
    model.compile(optimizer="sgd", loss="mse", run_eagerly=True)
    backend = object.__new__(ParameterServerStrategy)  # the check comes before any cluster is used
    with pytest.raises(KerasDistError, match="drop run_eagerly=True") as error:
        backend.run_loop("fit", model, None, {})
    assert "\n" not in str(error.value)


def test_upstream_keras_18624_sharded_variables_still_fail_in_plain_keras(tmp_path):
    # When one of these passes, Keras handles ShardedVariable and the workaround can go.
    model = make_model()
    split(model.get_layer("table").embeddings, 2)
    model.compile(optimizer="sgd", loss="mse")
    ids, targets = data(1)
    with pytest.raises(AttributeError, match="'ShardedVariable' object has no attribute 'handle'"):
        tf.function(model.train_step)((ids[0], targets[0]))
    with pytest.raises(AttributeError, match="'ShardedVariable' object has no attribute '__array__'"):
        model.save_weights(str(tmp_path / "model.weights.h5"))
