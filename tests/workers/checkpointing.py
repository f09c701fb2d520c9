"""Chief-only files and resume: every rank passes its own copy of the same callbacks.

    python checkpointing.py OUT_DIR EPOCHS [CRASH_AFTER_EPOCH [CRASH_RANK]]

Files go under OUT_DIR/files.RANK so a test can see which rank wrote what (a user's
script gives every rank the same path; the path differs here only to tell them apart).
The backup directory is shared, as on a shared file system. Each rank records the epochs
it ran and its final weights in OUT_DIR/result.RANK.pkl. With CRASH_AFTER_EPOCH, every rank
(or only CRASH_RANK) exits with code 3 at the end of that epoch, as a killed process would.
"""

import os
import pickle
import sys

import numpy as np
import keras

import keras_dist

out_dir, epochs = sys.argv[1], int(sys.argv[2])
crash_after = int(sys.argv[3]) if len(sys.argv) > 3 else None
crash_rank = int(sys.argv[4]) if len(sys.argv) > 4 else None
ctx = keras_dist.init()

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")

keras.utils.set_random_seed(7 + ctx.rank)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.05), loss="mse")


class RecordEpochs(keras.callbacks.Callback):
    epochs_run = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epochs_run.append(epoch)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == crash_after and crash_rank in (None, ctx.rank):
            os._exit(3)  # a crash: no clean-up, no flush


files = os.path.join(out_dir, f"files.{ctx.rank}")
callbacks = [
    keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
    keras.callbacks.ModelCheckpoint(os.path.join(files, "model.keras")),
    keras.callbacks.ModelCheckpoint(os.path.join(files, "best.weights.h5"), save_best_only=True, save_weights_only=True),
    keras.callbacks.TensorBoard(os.path.join(files, "tensorboard")),
    keras.callbacks.CSVLogger(os.path.join(files, "log.csv")),
    RecordEpochs(),
]
model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
with open(os.path.join(out_dir, f"result.{ctx.rank}.pkl"), "wb") as f:
    pickle.dump({"epochs_run": RecordEpochs.epochs_run, "weights": model.get_weights()}, f)
