"""The script's own saves and loads, as TensorFlow's distributed tutorials end, with the two-line change.

    script_saves.py OUT BATCH

Every process: fit, then `model.save(p)` and `keras.models.load_model(p)` at once, `save_weights`
then `load_weights`, 20 save-then-load rounds of a changed bias, the chief alone saving (nobody
waits), a sub-model cut out of the trained one predicting, the loaded model's `fit` with no
`keras_dist.compile` (distributed, or refused in one line on PyTorch), another loaded model
trained 2 epochs, evaluated, predicting and saving its weights, a teacher compiled by
`model.compile` and a subclass with a `compile` of its own trained 2 epochs, and a model kept
to each process by `keras_dist.local`. What each process wrote under OUT
is audited as it writes: the files Python opens for writing there (an audit hook), and the
bytes the process wrote in all (`/proc/self/io`, which sees HDF5's writes from C too). Writes
`OUT/report.RANK.json`.
"""

import json
import os
import sys
import time

import keras
import numpy as np

import keras_dist
from keras_dist.errors import KerasDistError

OUT, BATCH = sys.argv[1], int(sys.argv[2])
opened_for_writing = []


def audit(event, args):
    if event == "open" and isinstance(args[0], str) and args[0].startswith(OUT) and isinstance(args[1], str) \
            and any(c in args[1] for c in "wax+"):
        opened_for_writing.append(os.path.relpath(args[0], OUT))


def bytes_written():
    with open("/proc/self/io") as f:
        return int(dict(line.split(": ") for line in f.read().splitlines())["wchar"])


def audited(call):
    """`call()`'s bytes written by this process, and the files under OUT it opened for writing."""
    opened_for_writing.clear()
    before = bytes_written()
    call()
    return {"bytes": bytes_written() - before, "opened": sorted(set(opened_for_writing))}


def make_model():
    return keras.Sequential([keras.Input((8,)), keras.layers.Dense(2048, activation="relu", name="hidden"),
                             keras.layers.Dense(2, name="logits")])


keras.utils.set_random_seed(3)
rng = np.random.default_rng(0)
x = rng.random((96, 8)).astype("float32")
y = (x.sum(axis=1) > 4).astype("int32")
model = make_model()
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
strategy = keras_dist.current()
sys.addaudithook(audit)
report = {"rank": strategy.rank, "size": strategy.size}

path = os.path.join(OUT, "model.keras")
report["save"] = audited(lambda: model.save(path))
loaded = keras.models.load_model(path)
report["loaded_weights_equal"] = all(np.array_equal(a, b) for a, b in zip(loaded.get_weights(), model.get_weights()))
report["loaded_predicts"] = np.asarray(loaded.predict(x[:5], verbose=0)).tolist()

weights_path = os.path.join(OUT, "model.weights.h5")
report["save_weights"] = audited(lambda: model.save_weights(weights_path))
fresh = make_model()
fresh.load_weights(weights_path)
report["loaded_weights_equal_too"] = all(np.array_equal(a, b) for a, b in zip(fresh.get_weights(), model.get_weights()))

# Each round's file holds the round's bias: a read of a stale or partial file shows.
rounds = os.path.join(OUT, "rounds.keras")
seen = []
bias = model.get_layer("logits").bias
original = keras.ops.convert_to_numpy(bias)
for round_number in range(20):
    bias.assign(np.full(original.shape, round_number, original.dtype))
    model.save(rounds)
    seen.append(float(keras.ops.convert_to_numpy(keras.models.load_model(rounds).get_layer("logits").bias)[0]))
bias.assign(original)
report["rounds_seen"] = seen

if strategy.is_chief:  # Horovod's documented pattern: nobody else saves, nobody waits
    started = time.monotonic()
    model.save(os.path.join(OUT, "chief_alone.keras"))
    model.save_weights(os.path.join(OUT, "chief_alone.weights.h5"))
    report["chief_alone_seconds"] = time.monotonic() - started

sub_model = keras.Model(model.inputs, model.get_layer("hidden").output)
report["sub_model_predicts"] = np.asarray(sub_model.predict(x[:5], verbose=0)).shape

try:
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    report["loaded_fit"] = "trained"
except KerasDistError as error:
    report["loaded_fit"] = str(error)

# A loaded model trained as it is, as TensorFlow's multi-worker tutorial does (issue 67); on
# PyTorch keras_dist cannot see a compile outside it, so there the script compiles it again.
retrained = keras.models.load_model(path)
if keras.backend.backend() == "torch":
    keras_dist.compile(retrained)
retrained.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
report["retrained_weights"] = [w.tolist() for w in retrained.get_weights()]
report["retrained_evaluate"] = retrained.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
report["retrained_predict"] = np.asarray(retrained.predict(x[:7], batch_size=BATCH, verbose=0)).tolist()
retrained.save_weights(os.path.join(OUT, "retrained.weights.h5"))


class Scaled(keras.Model):
    """A subclass whose own `compile` takes its own arguments and calls `super().compile()`."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(2)

    def call(self, inputs):
        return self.dense(inputs) * self.scale

    def compile(self, learning_rate, scale):
        super().compile(optimizer=keras.optimizers.SGD(learning_rate),
                        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        self.scale = scale


# A teacher compiled by model.compile beside the student keras_dist compiled, and the subclass.
keras.utils.set_random_seed(4)
teacher, scaled = make_model(), Scaled()
if keras.backend.backend() != "torch":
    teacher.compile(optimizer=keras.optimizers.SGD(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    scaled.compile(0.1, scale=0.5)
else:
    keras_dist.compile(teacher, optimizer=keras.optimizers.SGD(0.05),
                       loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    keras_dist.compile(scaled, 0.1, scale=0.5)
for name, other in (("teacher", teacher), ("scaled", scaled)):
    other.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    report[f"{name}_weights"] = [w.tolist() for w in other.get_weights()]

if keras.backend.backend() == "tensorflow":
    # The multi-worker tutorial's own checkpoints: a tf.train.CheckpointManager saving on every
    # process into one directory, then Checkpoint.save, each restored at once (issue 67).
    import tensorflow as tf

    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    manager = tf.train.CheckpointManager(checkpoint, os.path.join(OUT, "ckpt"), max_to_keep=2)
    saved, wrote = [], 0
    if not strategy.is_chief:
        # Behind the chief, as a slower machine is: the chief has deleted ckpt-1 when this one saves it.
        time.sleep(3)
    for round_number in range(3):
        bias.assign(np.full(original.shape, 10 + round_number, original.dtype))
        before = bytes_written()
        saved.append(manager.save())
        wrote += bytes_written() - before
    before = bytes_written()
    saved.append(checkpoint.save(os.path.join(OUT, "single", "ckpt")))
    wrote += bytes_written() - before
    bias.assign(original)
    checkpoint.restore(tf.train.latest_checkpoint(os.path.join(OUT, "ckpt"))).assert_consumed()
    restored_bias = float(keras.ops.convert_to_numpy(bias)[0])
    checkpoint.restore(saved[-1])
    report["tf_checkpoints"] = {"saved": [os.path.relpath(p, OUT) for p in saved], "bytes": wrote,
                                "restored_bias": restored_bias,
                                "latest": os.path.relpath(tf.train.latest_checkpoint(os.path.join(OUT, "ckpt")), OUT),
                                "kept": sorted(os.listdir(os.path.join(OUT, "ckpt")))}
    bias.assign(original)

# keras_dist.local(model): each process trains its own, on the data it passes.
own = keras_dist.local(make_model())
own.compile(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
own.fit(x[strategy.rank::2], y[strategy.rank::2], batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
report["local_weights"] = [w.tolist() for w in own.get_weights()]
with open(os.path.join(OUT, f"report.{strategy.rank}.json"), "w") as f:
    json.dump(report, f)
print("done", strategy.rank, flush=True)
