"""A training script as a user would write it, run by the tests in a subprocess.

Usage: python train_worker.py OUT_DIR [--batch B] [--steps-per-execution K] [--cpus N] [--adam] [--layer-state] [--dataset]
Writes OUT_DIR/result-<rank>.json: final weights, history, evaluate and predict results.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--eval-samples", type=int, default=30)
parser.add_argument("--steps-per-execution", type=int, default=1)
parser.add_argument("--cpus", type=int, default=1, help="logical CPU devices (MirroredStrategy replicas)")
parser.add_argument("--callbacks", action="store_true", help="add checkpoint, backup and CSV callbacks")
parser.add_argument("--raw-keras", action="store_true", help="plain model.compile under the strategy")
parser.add_argument("--adam", action="store_true", help="Adam, made outside any scope, instead of SGD")
parser.add_argument("--dataset", action="store_true", help="fit on a tf.data.Dataset batched at --batch")
parser.add_argument("--model", choices=["sequential", "functional", "subclassed", "custom-step"], default="sequential",
                    help="how the script builds its model (always before keras_dist.compile)")
parser.add_argument("--layer-state", action="store_true", help="add Dropout and BatchNormalization (state set in call)")
args = parser.parse_args()

import tensorflow as tf  # noqa: E402

if args.cpus > 1:  # must precede anything that starts TensorFlow
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * args.cpus
    )

import numpy as np  # noqa: E402
import keras  # noqa: E402

import keras_dist  # noqa: E402

keras.utils.set_random_seed(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(args.samples, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1)) + 0.1).astype("float32")
state_layers = [keras.layers.Dropout(0.25, seed=3), keras.layers.BatchNormalization()] if args.layer_state else []


class TwoLayers(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))


class CustomStep(TwoLayers):
    """Keras's step plus a log that is no metric: epoch logs are then the last step's logs."""

    def train_step(self, data):
        return {**super().train_step(data), "first_prediction": self(data[0][:1])[0, 0]}


if args.model == "functional":
    inputs = keras.Input((5,))
    model = keras.Model(inputs, keras.layers.Dense(1)(keras.layers.Dense(4, activation="tanh")(inputs)))
elif args.model == "subclassed":
    model = TwoLayers()
    model(x[:1])  # built, its variables made, before keras_dist.compile
elif args.model == "custom-step":
    model = CustomStep()
    model(x[:1])
else:
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), *state_layers, keras.layers.Dense(1)])
initial = [w.tolist() for w in model.get_weights()]
optimizer = keras.optimizers.Adam(0.02) if args.adam else keras.optimizers.SGD(0.05)
keras_dist.compile(model, optimizer=optimizer, loss="mse", metrics=["mae"],
                   steps_per_execution=args.steps_per_execution)
ctx = keras_dist.current()
callbacks = []
if args.callbacks:
    callbacks = [
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt.weights.h5"), save_weights_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup")),
        keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv")),
    ]
# The evaluation slice doubles as validation data: shards of uneven length inside fit too.
validation = (x[:args.eval_samples], y[:args.eval_samples])
inputs = {"x": tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch)} if args.dataset else \
    {"x": x, "y": y, "batch_size": args.batch}
history = model.fit(**inputs, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks,
                    validation_data=validation)
evaluation = model.evaluate(x[:args.eval_samples], y[:args.eval_samples], batch_size=args.batch, verbose=0, return_dict=True)
prediction = model.predict(x[:args.eval_samples], batch_size=args.batch, verbose=0)
result = {
    "describe": ctx.describe(),
    "initial": initial,
    "weights": [w.tolist() for w in model.get_weights()],
    "trainable_weights": [w.numpy().tolist() for w in model.trainable_weights],
    "history": history.history,
    "evaluate": evaluation,
    "predict": prediction.tolist(),
    "reference_predict": model(x[:args.eval_samples]).numpy().tolist(),
    # Parts per variable: more than 1 where a parameter-server partitioner split it.
    "shards": [len(getattr(v.value, "variables", [v])) for v in model.variables],
}
with open(os.path.join(args.out, f"result-{ctx.rank}.json"), "w") as f:
    json.dump(result, f)
print("done", ctx.describe(), flush=True)
