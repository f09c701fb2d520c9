"""Trains with `BackupAndRestore(BACKUP_DIR, save_freq=10)`; a backup is about 1 MB (Adam's slots too).

    python disk_full.py BACKUP_DIR
"""

import sys

import keras
import numpy as np

import keras_dist

rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 64)).astype("float32")
y = rng.integers(0, 10, 2048)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
keras_dist.compile(model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(sys.argv[1], save_freq=10)])
print("trained", flush=True)
