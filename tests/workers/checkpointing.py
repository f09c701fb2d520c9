"""Chief-only files: every rank passes its own copy of the same callbacks.

    python checkpointing.py OUT_DIR EPOCHS

Files go under OUT_DIR/files.RANK so a test can see which rank wrote what (a user's
script gives every rank the same path; the path differs here only to tell them apart).
The backup directory is shared, as on a shared file system.
"""

import os
import sys

import numpy as np
import keras

import keras_dist

out_dir, epochs = sys.argv[1], int(sys.argv[2])
ctx = keras_dist.init()

rng = np.random.default_rng(0)
x = rng.normal(size=(128, 4)).astype("float32")
y = x @ np.array([[1.0], [-2.0], [0.5], [3.0]], dtype="float32")

keras.utils.set_random_seed(7 + ctx.rank)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.05), loss="mse")


files = os.path.join(out_dir, f"files.{ctx.rank}")
callbacks = [
    keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
    keras.callbacks.ModelCheckpoint(os.path.join(files, "model.keras")),
    keras.callbacks.ModelCheckpoint(os.path.join(files, "best.weights.h5"), save_best_only=True, save_weights_only=True),
    keras.callbacks.TensorBoard(os.path.join(files, "tensorboard")),
    keras.callbacks.CSVLogger(os.path.join(files, "log.csv")),
]
model.fit(x, y, batch_size=16, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
