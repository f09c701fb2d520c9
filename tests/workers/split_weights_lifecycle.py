"""A script's life around fits, with and without shard="weights", on 2 processes.

    python split_weights_lifecycle.py RESULT_JSON none|optimizer|weights|created

evaluate and predict before any fit (shards of unequal length), model.save from a callback
on every process inside fit, a `ModelCheckpoint(save_best_only=True)` kept across the
fits (the chief leads its saves: a stand-in's own decision may differ), a
`ModelCheckpoint(save_freq=3)` kept across them (its batch counter carries from one fit
into the next on every process, a fit of another, unsharded model included; the script
then changes it to every second batch), one
passed through `keras_dist.callbacks.chief_only` (the chief's already, as Keras's own file
callbacks are), then the transfer-learning recipe (freeze, compile again, fit) and
evaluate; the chief writes the evaluations, the losses and the final weights.
Before the last fit the script saves, trains a detour, and the chief alone loads the save
back. `created` builds the model in `keras_dist.split_weights()`, its first layer frozen
before the first compile.
"""

import json
import sys

import keras
import numpy as np

import keras_dist

context = keras_dist.init()
keras.utils.set_random_seed(0)


def build() -> keras.Model:
    return keras.Sequential([keras.Input((5,)), keras.layers.Dense(3), keras.layers.Dense(4, activation="tanh"),
                             keras.layers.Dense(1)])


if sys.argv[2] == "created":
    with keras_dist.split_weights():
        model = build()
else:
    model = build()
model.layers[0].trainable = False
shard = sys.argv[2] if sys.argv[2] in ("optimizer", "weights") else None
keras_dist.compile(model, optimizer="adam", loss="mse", shard=shard)
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 5)).astype("float32"), rng.normal(size=(64, 1)).astype("float32")
before = model.evaluate(x[:21], y[:21], batch_size=5, verbose=0)  # 3 steps on rank 0, 2 on rank 1
model.predict(x[:9], batch_size=4, verbose=0)


class SaveInFit(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        self.model.save(sys.argv[1] + ".in-fit.keras")


best = keras.callbacks.ModelCheckpoint(sys.argv[1] + ".best.weights.h5", monitor="loss", mode="max",
                                       save_best_only=True, save_weights_only=True)
every_third = keras.callbacks.ModelCheckpoint(sys.argv[1] + ".every-third.weights.h5", save_freq=3,
                                              save_weights_only=True)
chief_only = keras_dist.callbacks.chief_only(
    keras.callbacks.ModelCheckpoint(sys.argv[1] + ".chief-only.weights.h5", save_weights_only=True))
history = model.fit(x, y, batch_size=8, epochs=2, verbose=0, shuffle=False,
                    callbacks=[SaveInFit(), best, every_third, chief_only])
model.layers[1].trainable = False
keras_dist.compile(model, optimizer="adam", loss="mse", shard=shard)
# 4 steps an epoch: the chief's counter saves at the second fit's first batch.
frozen = model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False,
                   callbacks=[best, every_third])
# A script that goes back to its own file before the last fit, the chief alone loading it
# (weights split for good load on every process): every process trains on from the chief's
# weights and optimizer state, each its share of that state.
model.save_weights(sys.argv[1] + ".before-detour.weights.h5")
model.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=2, verbose=0, shuffle=False)
if context.is_chief or sys.argv[2] == "created":
    model.load_weights(sys.argv[1] + ".before-detour.weights.h5")
# One batch of another, unsharded model with the same checkpoint: its counter moves on the
# chief alone (the others leave a checkpoint of an unsharded fit to it).
side = build()
keras_dist.compile(side, optimizer="sgd", loss="mse")
side.fit(x, y, batch_size=8, epochs=1, steps_per_epoch=1, verbose=0, shuffle=False, callbacks=[every_third])
every_third.save_freq = 2  # changed between fits: every process's copy saves every second batch now
frozen.history["loss"] += model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False,
                                    callbacks=[best, every_third]).history["loss"]
kept = {}
for name in ("every-third", "chief-only"):  # saved at the last batch (every second by then); the first fit's end
    kept_model = build()
    kept_model.load_weights(f"{sys.argv[1]}.{name}.weights.h5")
    kept[name] = [w.tolist() for w in kept_model.get_weights()]
after = model.evaluate(x[:21], y[:21], batch_size=4, verbose=0)
saved = keras.models.load_model(sys.argv[1] + ".in-fit.keras")
weights = model.get_weights()  # on every process: a collective where the weights are split for good
best_model = build()
best_model.load_weights(sys.argv[1] + ".best.weights.h5")
if context.is_chief:
    with open(sys.argv[1], "w") as f:
        json.dump({"evaluate": [before, after], "loss": history.history["loss"] + frozen.history["loss"],
                   "saved_in_fit": [w.tolist() for w in saved.get_weights()],
                   "best": [w.tolist() for w in best_model.get_weights()], **kept,
                   "weights": [w.tolist() for w in weights]}, f)
