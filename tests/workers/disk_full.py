"""Trains with `BackupAndRestore(BACKUP_DIR, save_freq=10)`; a backup is about 1 MB (Adam's slots too).

    python disk_full.py BACKUP_DIR [--logs DIR] [--remove-backup-dir-at STEP] [--checkpoints DIR] [--no-backup]

`--logs DIR` adds a `CSVLogger` and a `TensorBoard` writing under DIR. `--remove-backup-dir-at
STEP` removes BACKUP_DIR (on the chief, as a clean-up job on its machine would) once
training reaches that step of the first epoch. `--checkpoints DIR` adds a `ModelCheckpoint`
of the weights every 10 steps, a file each (about 0.3 MB). `--no-backup` leaves the script
without its `BackupAndRestore` (`keras-dist launch --backup-dir` gives one).
"""

import argparse
import os
import shutil

import keras
import numpy as np

import keras_dist

parser = argparse.ArgumentParser()
parser.add_argument("backup_dir")
parser.add_argument("--logs")
parser.add_argument("--remove-backup-dir-at", type=int)
parser.add_argument("--checkpoints")
parser.add_argument("--no-backup", action="store_true")
args = parser.parse_args()


class RemoveBackupDir(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == args.remove_backup_dir_at and keras_dist.current().is_chief and os.path.isdir(args.backup_dir):
            # As `rm -rf` does: keras_dist's backup writer may rename or add a file meanwhile.
            while os.path.isdir(args.backup_dir):
                shutil.rmtree(args.backup_dir, ignore_errors=True)
            print(f"removed {args.backup_dir} at step {batch}", flush=True)


rng = np.random.default_rng(0)
x = rng.normal(size=(2048, 64)).astype("float32")
y = rng.integers(0, 10, 2048)
model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)])
keras_dist.compile(model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
callbacks = [] if args.no_backup else [keras.callbacks.BackupAndRestore(args.backup_dir, save_freq=10,
                                                                        delete_checkpoint=False)]
if args.checkpoints:
    callbacks.append(keras.callbacks.ModelCheckpoint(os.path.join(args.checkpoints, "{epoch}-{batch}.weights.h5"),
                                                     save_freq=10, save_weights_only=True))
if args.logs:
    callbacks += [keras.callbacks.CSVLogger(os.path.join(args.logs, "log.csv")),
                  keras.callbacks.TensorBoard(os.path.join(args.logs, "tensorboard"), update_freq=5)]
if args.remove_backup_dir_at is not None:
    callbacks.append(RemoveBackupDir())
model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=callbacks)
print("trained", flush=True)
