"""The script's own saves and loads, as TensorFlow's distributed tutorials end, with the two-line change.

    script_saves.py OUT BATCH

Every process: fit, then `model.save(p)` and `keras.models.load_model(p)` at once, `save_weights`
then `load_weights`, 20 save-then-load rounds of a changed bias, the chief alone saving (nobody
waits), a sub-model cut out of the trained one predicting, the loaded model's `fit` (refused in
one line where keras_dist can tell, in a job of several processes) and the loaded model
recompiled by `keras_dist.compile(model)` trained 2 epochs. What each process wrote under OUT
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

retrained = keras.models.load_model(path)
keras_dist.compile(retrained)
retrained.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
report["retrained_weights"] = [w.tolist() for w in retrained.get_weights()]
with open(os.path.join(OUT, f"report.{strategy.rank}.json"), "w") as f:
    json.dump(report, f)
print("done", strategy.rank, flush=True)
