"""Training scenarios run identically under horovodrun (N ranks) and as one process.

    python horovod_scenarios.py OUT_DIR SCENARIO [SCENARIO ...]

The global batch is fixed (GLOBAL_BATCH), so each rank uses GLOBAL_BATCH / size: N ranks
at batch B and one process at N*B must then end with the same weights. Each rank starts
from different random weights (seed 1000 + rank), so matching the single process also
shows that rank 0's weights were broadcast. Results: OUT_DIR/SCENARIO.RANK.pkl.
"""

import os
import pickle
import sys

import numpy as np
import keras
import tensorflow as tf

import keras_dist

GLOBAL_BATCH = 32
ctx = keras_dist.init()
BATCH = GLOBAL_BATCH // ctx.size


def data(count, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 6)).astype("float32")
    y = (np.argmax(x[:, :3] + 0.5 * x[:, 3:], axis=1)).astype("int32")
    return x, y


def model(width=8):
    keras.utils.set_random_seed(1000 + ctx.rank)
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(width, activation="tanh"), keras.layers.Dense(3)])


def compiled(optimizer, **options):
    m = model()
    keras_dist.compile(
        m, optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"], **options,
    )
    return m


class StepCounter(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.train_batches, self.learning_rates = 0, []

    def on_train_batch_begin(self, batch, logs=None):
        self.learning_rates.append(float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate)))

    def on_train_batch_end(self, batch, logs=None):
        self.train_batches += 1


def train(m, x, y, epochs=2, **fit_args):
    counter = StepCounter()
    history = m.fit(x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=[counter], **fit_args)
    return {"weights": m.get_weights(), "history": history.history, "steps": counter.train_batches, "lrs": counter.learning_rates}


class MomentumByHand(keras.optimizers.SGD):
    """A user subclass with its own update rule (no Keras momentum)."""

    def build(self, variables):
        super().build(variables)
        self.velocities = [self.add_variable_from_reference(v, "velocity") for v in variables]

    def update_step(self, gradient, variable, learning_rate):
        velocity = self.velocities[self._get_variable_index(variable)]
        velocity.assign(0.9 * velocity + gradient)
        variable.assign_sub(learning_rate * velocity)


def scenario_sgd_arrays():
    x, y = data(250)
    return train(compiled(keras.optimizers.SGD(0.1)), x, y, validation_split=0.2)


def scenario_sgd_dataset():
    x, y = data(250)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    m = compiled(keras.optimizers.SGD(0.1))
    history = m.fit(dataset, epochs=2, verbose=0)
    return {"weights": m.get_weights(), "history": history.history}


def scenario_dataset_map_shuffled():
    # A user's pipeline: slices, a seeded shuffle, per-element work, batch, prefetch.
    x, y = data(256)
    dataset = (tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=7)
               .map(lambda a, b: (tf.tanh(a) * 2.0, b), num_parallel_calls=tf.data.AUTOTUNE)
               .batch(BATCH).prefetch(tf.data.AUTOTUNE))
    m = compiled(keras.optimizers.SGD(0.1))
    history = m.fit(dataset, epochs=2, verbose=0)
    return {"weights": m.get_weights(), "history": history.history}


class BatchLosses(keras.callbacks.Callback):
    """Reads per-batch logs, so every train step must make them global."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(logs["loss"])


def scenario_batch_logs():
    x, y = data(256)
    m, reader = compiled(keras.optimizers.SGD(0.1)), BatchLosses()
    m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)  # no reader: logs global per epoch only
    history = m.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[reader])
    return {"batch_losses": reader.losses, "history": history.history}


def scenario_sum_reduction():
    x, y = data(250)
    # Summing N rank-mean gradients at lr/N is the mean at lr: same as sgd_plain.
    return train(compiled(keras.optimizers.SGD(0.1 / ctx.size), gradient_reduction="sum"), x, y)


def scenario_sgd_plain():
    x, y = data(250)
    return train(compiled(keras.optimizers.SGD(0.1)), x, y)


def scenario_fp16_compression():
    x, y = data(250)
    return train(compiled(keras.optimizers.SGD(0.1), gradient_compression="fp16"), x, y)


def scenario_adam_schedule():
    x, y = data(250)
    schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=3, decay_rate=0.5)
    return train(compiled(keras.optimizers.Adam(schedule)), x, y)


def scenario_user_optimizer():
    x, y = data(250)
    return train(compiled(MomentumByHand(0.05)), x, y)


def scenario_global_clipnorm():
    x, y = data(250)
    return train(compiled(keras.optimizers.SGD(0.5, global_clipnorm=0.1)), x, y)


def scenario_gradient_accumulation():
    x, y = data(256)
    return train(compiled(keras.optimizers.SGD(0.1, gradient_accumulation_steps=2)), x, y)


def scenario_loss_scale():
    x, y = data(256)
    optimizer = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=2.0**10)
    return train(compiled(optimizer), x, y)


def scenario_uneven_shards():
    x, y = data(101)  # 51 and 50 examples: equal steps need padding, or rank 0 would hang
    return train(compiled(keras.optimizers.SGD(0.1)), x, y, epochs=1)


def scenario_evaluate_predict():
    m = compiled(keras.optimizers.SGD(0.1))  # untrained: rank 0's weights must win
    x, y = data(101, seed=1)  # uneven evaluation shards: 6 and 5 batches of 10
    logs = m.evaluate(x, y, batch_size=10, return_dict=True, verbose=0)
    dataset_logs = m.evaluate(tf.data.Dataset.from_tensor_slices((x, y)).batch(10), return_dict=True, verbose=0)
    return {"evaluate": logs, "evaluate_dataset": dataset_logs, "predict": m.predict(x, batch_size=10, verbose=0),
            "predict_dataset": m.predict(tf.data.Dataset.from_tensor_slices(x).batch(7), verbose=0)}


def scenario_learning_rate_scaling():
    x, y = data(256)
    m = compiled(keras.optimizers.SGD(0.1), scale_learning_rate=True)
    counter = StepCounter()
    m.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
          callbacks=[keras_dist.callbacks.LearningRateWarmup(warmup_epochs=1), counter])
    return {"lrs": counter.learning_rates}


# An optimizer the model does not hold: keras_dist cannot find it, nothing reduces its updates.
HIDDEN_OPTIMIZER = keras.optimizers.SGD(0.1)


class HiddenOptimizer(keras.Model):
    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        HIDDEN_OPTIMIZER.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {"loss": loss}


def scenario_unreduced_optimizer():
    x, y = data(128, seed=ctx.rank)  # each rank its own data: unreduced updates differ
    keras.utils.set_random_seed(1000 + ctx.rank)
    inputs = keras.Input((6,))
    m = HiddenOptimizer(inputs, keras.layers.Dense(3)(inputs))
    keras_dist.compile(m, optimizer=keras.optimizers.SGD(0.1),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        m.fit(x, y, batch_size=BATCH, epochs=3, verbose=0)
    except keras_dist.KerasDistError as exc:
        return {"error": str(exc)}
    return {"error": None}


def main():
    out_dir, names = sys.argv[1], sys.argv[2:]
    for name in names:
        result = globals()[f"scenario_{name}"]()
        with open(os.path.join(out_dir, f"{name}.{ctx.rank}.pkl"), "wb") as f:
            pickle.dump(result, f)


if __name__ == "__main__":
    main()
