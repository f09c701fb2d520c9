"""A parameter-server training script for the fault-tolerance tests (the chief runs it all).

    python ps_training.py OUT_DIR EPOCHS STEPS_PER_EPOCH [--hold-evaluation] [--arrays] [--hold-train E:S]

Trains from a dataset function (built on every worker) with BackupAndRestore in
OUT_DIR/backup, prints "epoch N begin" as each epoch starts (the tests kill tasks on
cue). With --arrays it trains from NumPy arrays instead, which the chief reads batch by
batch (an eager operation of its own before each step). With --hold-evaluation it prints
"evaluate step 8" in the middle of the final evaluation, with --hold-train E:S "train
step S of epoch E" as that step begins (the steps before it in flight or done), and waits
there until OUT_DIR/resume exists (at most 120 s). It writes
OUT_DIR/result.json: epochs run, their durations, the optimizer's step count, the
history, and `evaluate` and `predict` with their values computed here from the weights.
"""

import json
import os
import sys
import time

import numpy as np
import keras
import tensorflow as tf

import keras_dist

out_dir, epochs, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
hold_evaluation = "--hold-evaluation" in sys.argv[4:]
arrays = "--arrays" in sys.argv[4:]
hold_train = None
if "--hold-train" in sys.argv:  # (epoch, step)
    hold_train = tuple(map(int, sys.argv[sys.argv.index("--hold-train") + 1].split(":")))
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x @ rng.normal(size=(8, 1))).astype("float32")


def dataset_fn(input_context):
    # Built on each worker: its own endless, shuffled copy of the data.
    return tf.data.Dataset.from_tensor_slices((x, y)).shuffle(512).repeat().batch(16)


keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"])


class EpochLog(keras.callbacks.Callback):
    epochs, seconds = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.monotonic()
        self.epochs.append(epoch)
        print(f"epoch {epoch} begin", flush=True)

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.monotonic() - self.start)


def hold(line):
    print(line, flush=True)
    deadline = time.monotonic() + 120
    while not os.path.exists(os.path.join(out_dir, "resume")) and time.monotonic() < deadline:
        time.sleep(0.05)


class HoldTraining(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == hold_train:
            hold(f"train step {batch} of epoch {self.epoch}")


callbacks = [keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")), EpochLog(), HoldTraining()]
if arrays:  # `steps` batches of 16 an epoch
    repeats = (steps * 16 // len(x) + 1, 1)
    history = model.fit(np.tile(x, repeats)[:steps * 16], np.tile(y, repeats)[:steps * 16], batch_size=16,
                        epochs=epochs, verbose=0, callbacks=callbacks)
else:
    history = model.fit(dataset_fn, epochs=epochs, steps_per_epoch=steps, verbose=0, callbacks=callbacks)


class HoldEvaluation(keras.callbacks.Callback):
    def on_test_batch_begin(self, batch, logs=None):
        if batch == 8:  # 7 finished steps not yet fetched; the next steps are not scheduled yet
            hold("evaluate step 8")


x_eval, y_eval = np.tile(x, (4, 1)), np.tile(y, (4, 1))  # 32 steps of 64
evaluation = model.evaluate(x_eval, y_eval, batch_size=64, verbose=0, return_dict=True,
                            callbacks=[HoldEvaluation()] if hold_evaluation else [])
predictions = model.predict(x, batch_size=100, verbose=0)
kernel, bias, out_kernel, out_bias = model.get_weights()
expected = np.maximum(x @ kernel + bias, 0) @ out_kernel + out_bias
with open(os.path.join(out_dir, "result.json"), "w") as f:
    json.dump({"epochs_run": EpochLog.epochs, "epoch_seconds": EpochLog.seconds, "history": history.history,
               "iterations": int(model.optimizer.iterations.numpy()), "evaluate": evaluation,
               "reference_mse": float(np.mean((expected - y) ** 2)),
               "predict_error": float(np.max(np.abs(predictions - expected)))}, f)
print("done", flush=True)
