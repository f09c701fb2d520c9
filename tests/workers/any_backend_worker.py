"""A training script as a user would write it, on whichever Keras backend KERAS_BACKEND names.

Usage: python any_backend_worker.py OUT_DIR [--batch B] [--samples N] [--eval-samples M]
       [--epochs E] [--callbacks [chief]] [--adam] [--global-clipnorm C] [--clipnorm C] [--shard optimizer|weights] [--steps-per-execution S] [--save every|chief] [--dataset | --pydataset] [--two-optimizers] [--recompile] [--early-stopping]
       [--kill-rank R --kill-epoch K]
Imports no framework itself, so the test can see what keras_dist imports. Writes
OUT_DIR/result-<rank>.json: weights, history, evaluate and predict results, and which of
TensorFlow and Horovod keras_dist imported.
"""

import argparse
import gc
import json
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, default=8)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--samples", type=int, default=64)
parser.add_argument("--eval-samples", type=int, default=17)
parser.add_argument("--callbacks", nargs="?", const="every", choices=["every", "chief"],
                    help="add checkpoint, backup and CSV callbacks (chief: on the chief alone, as Horovod's examples do)")
parser.add_argument("--adam", action="store_true")
parser.add_argument("--global-clipnorm", type=float, help="the optimizer's global_clipnorm")
parser.add_argument("--clipnorm", type=float, help="the optimizer's clipnorm")
parser.add_argument("--early-stopping", action="store_true",
                    help="EarlyStopping restoring the best weights, as a rising loss stops the run after epoch 2")
parser.add_argument("--shard", choices=["optimizer", "weights"], help="keras_dist's shard")
parser.add_argument("--steps-per-execution", type=int, default=1)
parser.add_argument("--save", choices=["every", "chief"],
                    help="every process, or the chief alone, calls model.save(OUT_DIR/model.keras) after fit")
parser.add_argument("--compression", choices=["fp16", "bf16"], help="keras_dist's gradient_compression")
parser.add_argument("--dataset", action="store_true", help="fit on a tf.data pipeline (shuffle with a seed, map, batch)")
parser.add_argument("--pydataset", action="store_true",
                    help="fit, validate, evaluate and predict on keras.utils.PyDataset batches")
parser.add_argument("--two-optimizers", action="store_true",
                    help="PyTorch only: a custom train_step with two backward passes, each layer its own optimizer")
parser.add_argument("--recompile", action="store_true",
                    help="after fit, freeze the first layer, compile again with a new optimizer and fit on")
parser.add_argument("--kill-rank", type=int, help="this rank kills itself at the end of --kill-epoch")
parser.add_argument("--kill-epoch", type=int, default=0)
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402

ctx = keras_dist.init()
# What keras_dist imported, before the script's own seeding (Keras seeds TensorFlow too, where installed).
imported = sorted(m for m in ("tensorflow", "horovod") if m in sys.modules)
keras.utils.set_random_seed(1)
rng = np.random.default_rng(0)
x = rng.normal(size=(args.samples, 5)).astype("float32")
y = (x @ rng.normal(size=(5, 1)) + 0.1).astype("float32")


class TwoOptimizers(keras.Model):
    """A custom PyTorch train_step in the shape of a GAN's: two backward passes per step,
    each followed by the update of one layer, with an optimizer of its own."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(4, activation="tanh")
        self.out = keras.layers.Dense(1)

    def call(self, inputs):
        return self.out(self.hidden(inputs))

    def compile(self, hidden_optimizer, out_optimizer, **kwargs):
        super().compile(**kwargs)
        self.hidden_optimizer, self.out_optimizer = hidden_optimizer, out_optimizer

    def train_step(self, data):
        x, y = data
        for layer, optimizer in ((self.out, self.out_optimizer), (self.hidden, self.hidden_optimizer)):
            self.zero_grad()
            loss = keras.ops.mean((self(x) - y) ** 2)
            loss.backward()  # gradients for both layers; one is updated
            optimizer.apply([v.value.grad for v in layer.trainable_weights], layer.trainable_weights)
        return self.compute_metrics(x, y, self(x))


def optimizer():
    kind, rate = (keras.optimizers.Adam, 0.02) if args.adam else (keras.optimizers.SGD, 0.05)
    return kind(rate, global_clipnorm=args.global_clipnorm, clipnorm=args.clipnorm)


if args.two_optimizers:
    model = TwoOptimizers()
    keras_dist.compile(model, hidden_optimizer=optimizer(), out_optimizer=optimizer(), loss="mse", metrics=["mae"])
else:
    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)])
    keras_dist.compile(model, optimizer=optimizer(), loss="mse", metrics=["mae"], gradient_compression=args.compression,
                       steps_per_execution=args.steps_per_execution, **({"shard": args.shard} if args.shard else {}))


def held_bytes(variable):
    """The bytes of a float32 variable this process holds: its own parts where JAX splits it over processes."""
    shards = getattr(variable.value, "addressable_shards", None)
    shapes = [shard.data.shape for shard in shards] if shards is not None else [variable.shape]
    return sum(int(np.prod(shape)) * 4 for shape in shapes)


class KillAtEpochEnd(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if ctx.rank == args.kill_rank and epoch == args.kill_epoch:
            os.kill(os.getpid(), 9)


def trainable_bytes_in_torch():
    """The bytes of every trainable torch tensor this process holds: the model's variables and
    any slices of them keras_dist keeps (shard="weights"), by their storage, however held."""
    import torch

    storages = {}
    for obj in gc.get_objects():
        if type(obj) is torch.nn.Parameter and obj.requires_grad:
            storage = obj.untyped_storage()
            storages[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(storages.values())


class HeldAtTrainEnd(keras.callbacks.Callback):
    """The bytes of trainable weights this process holds at fit's end, still inside fit."""

    held = None

    def on_train_end(self, logs=None):
        HeldAtTrainEnd.held = trainable_bytes_in_torch() if keras.backend.backend() == "torch" else \
            sum(held_bytes(v) for v in self.model.trainable_variables)


callbacks = [KillAtEpochEnd(), HeldAtTrainEnd()]
if args.early_stopping:  # a falling loss counts as no improvement: stops after epoch 2, restores epoch 1's weights
    callbacks.append(keras.callbacks.EarlyStopping(monitor="loss", mode="max", patience=1, restore_best_weights=True))
if args.callbacks == "every" or (args.callbacks == "chief" and ctx.is_chief):
    callbacks += [
        keras.callbacks.ModelCheckpoint(os.path.join(args.out, "ckpt.weights.h5"), save_weights_only=True),
        keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup")),
        keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv")),
    ]


class Batches(keras.utils.PyDataset):
    """Consecutive batches of arrays, as a script's own PyDataset serves them."""

    def __init__(self, *arrays):
        super().__init__()
        self.arrays = arrays

    def __len__(self):
        return -(-len(self.arrays[0]) // args.batch)

    def __getitem__(self, index):
        part = tuple(a[index * args.batch:(index + 1) * args.batch] for a in self.arrays)
        return part if len(part) > 1 else part[0]


validation = (x[:args.eval_samples], y[:args.eval_samples])  # uneven shards inside fit too
evaluation_inputs = {"x": validation[0], "y": validation[1], "batch_size": args.batch}
prediction_inputs = {"x": validation[0], "batch_size": args.batch}
if args.pydataset:
    inputs = {"x": Batches(x, y)}
    validation = Batches(*validation)
    evaluation_inputs, prediction_inputs = {"x": validation}, {"x": Batches(validation.arrays[0])}
elif args.dataset:  # TensorFlow only for the input, as Keras on JAX or PyTorch allows
    import tensorflow as tf

    inputs = {"x": tf.data.Dataset.from_tensor_slices((x, y)).shuffle(64, seed=5).map(lambda a, b: (a * 2.0, b))
              .batch(args.batch)}
else:
    inputs = {"x": x, "y": y, "batch_size": args.batch}
history = model.fit(**inputs, epochs=args.epochs, shuffle=False, verbose=0, callbacks=callbacks,
                    validation_data=validation)
if args.recompile:  # the transfer-learning recipe
    model.layers[0].trainable = False
    keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.02), loss="mse", metrics=["mae"])
    for key, values in model.fit(**inputs, epochs=1, shuffle=False, verbose=0).history.items():
        history.history[f"recompiled_{key}"] = values
if args.save == "chief":  # the script ends with the chief's save, as tutorials write it
    if ctx.is_chief:
        model.save(os.path.join(args.out, "model.keras"))
    sys.exit(0)
if args.save == "every":
    model.save(os.path.join(args.out, "model.keras"))
evaluation = model.evaluate(**evaluation_inputs, verbose=0, return_dict=True)
prediction = model.predict(**prediction_inputs, verbose=0)
result = {
    "describe": ctx.describe(),
    "keras_backend": keras.backend.backend(),
    "imported_by_keras_dist": imported,
    "weights": [w.tolist() for w in model.get_weights()],
    "history": history.history,
    "evaluate": evaluation,
    "predict": prediction.tolist(),
    "optimizer_state_bytes": sum(held_bytes(v) for v in model.optimizer.variables),
    "weights_bytes_in_fit": HeldAtTrainEnd.held,
}
with open(os.path.join(args.out, f"result-{ctx.rank}.json"), "w") as f:
    json.dump(result, f)
print("done", ctx.describe(), flush=True)
