"""A user's script with checkpoints, a backup and validation, and one fault at a chosen moment.

    python fault_matrix.py OUT_DIR EPOCHS [FAULT MOMENT RANK EPOCH]

FAULT is `kill` (SIGKILL) or `freeze` (SIGSTOP); MOMENT is `mid_epoch` (the second train
step), `save` (while the chief writes a checkpoint, seen from any rank as its partial file)
or `evaluate` (the second validation step); RANK is the process it hits, EPOCH the epoch.
Just before the fault, the process writes OUT_DIR/fault.json (when, what). Every rank
appends each epoch it begins to OUT_DIR/epochs.RANK and, at the end, writes its final
weights to OUT_DIR/weights.RANK.npz.
"""

import glob
import json
import os
import signal
import sys
import threading
import time

import numpy as np
import keras

import keras_dist
from keras_dist.fault_tolerance import background_writes

out_dir, epochs = sys.argv[1], int(sys.argv[2])
fault, moment, fault_rank, fault_epoch = (sys.argv[3], sys.argv[4], int(sys.argv[5]), int(sys.argv[6])) \
    if len(sys.argv) > 3 else (None, None, None, None)
ctx = keras_dist.init()
hit = ctx.rank == fault_rank

rng = np.random.default_rng(0)
x = rng.normal(size=(48, 2000)).astype("float32")
y = x[:, :1] - x[:, 1:2]
keras.utils.set_random_seed(1)
# 16 MB of weights (48 MB backed up with Adam's moments): a save takes long enough to be caught.
model = keras.Sequential([keras.Input((2000,)), keras.layers.Dense(2000), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer=keras.optimizers.Adam(1e-4), loss="mse")


def inject(what):
    with open(os.path.join(out_dir, "fault.json"), "w") as f:
        json.dump({"time": time.time(), "fault": fault, "moment": what, "rank": ctx.rank}, f)
    os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)


def inject_once_a_save_is_in_progress():
    partials = [os.path.join(out_dir, ".keras_dist-partial-*"), os.path.join(out_dir, "backup", ".keras_dist-partial-*")]
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if any(glob.glob(pattern) for pattern in partials):
            inject("save")
        time.sleep(0.001)
    print("fault_matrix: no save was caught in progress", flush=True)
    os._exit(4)


class Fault(keras.callbacks.Callback):
    epoch = None

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        with open(os.path.join(out_dir, f"epochs.{ctx.rank}"), "a") as f:
            f.write(f"{epoch}\n")

    def on_train_batch_begin(self, batch, logs=None):
        if hit and moment == "mid_epoch" and self.epoch == fault_epoch and batch == 1:
            background_writes.wait_for_all()  # the epoch before is backed up: see `evaluate`
            inject("mid_epoch")
        if hit and moment == "save" and self.epoch == fault_epoch and batch == 0:
            # The backup of the epoch before is written in the background: on disk first,
            # so that the fault meets a save of this epoch.
            background_writes.wait_for_all()
            threading.Thread(target=inject_once_a_save_is_in_progress, daemon=True).start()

    def on_test_batch_begin(self, batch, logs=None):
        if hit and moment == "evaluate" and self.epoch == fault_epoch and batch == 1:
            # The backup of the epoch before is written in the background: on disk first, so
            # that a rerun resumes at this epoch (under load a frozen chief had not yet
            # committed it once, and the rerun began the epoch before again).
            background_writes.wait_for_all()
            inject("evaluate")


model.fit(x[:32], y[:32], batch_size=4, epochs=epochs, shuffle=False, verbose=0,
          validation_data=(x[32:], y[32:]), validation_batch_size=4, callbacks=[
              Fault(),
              keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "model.keras")),
              keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup")),
          ])
np.savez(os.path.join(out_dir, f"weights.{ctx.rank}.npz"), *model.get_weights())
