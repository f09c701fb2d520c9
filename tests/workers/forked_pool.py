"""One process: `fit` on a `PyDataset(use_multiprocessing=True)` with a `BackupAndRestore`
(keras_dist then sets its preemption notice's handlers while `fit` runs).

    python forked_pool.py BACKUP_DIR
"""

import sys

import keras
import numpy as np

import keras_dist


class Batches(keras.utils.PyDataset):
    def __init__(self):
        super().__init__(workers=2, use_multiprocessing=True)  # forked pool workers
        rng = np.random.default_rng(0)
        self.x, self.y = rng.normal(size=(256, 8)).astype("float32"), rng.normal(size=(256, 1)).astype("float32")

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return self.x[i * 32:(i + 1) * 32], self.y[i * 32:(i + 1) * 32]


model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
model.fit(Batches(), epochs=2, verbose=0, callbacks=[keras.callbacks.BackupAndRestore(sys.argv[1])])
print("trained", flush=True)
