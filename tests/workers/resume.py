"""A two-line script with `BackupAndRestore(save_freq=args.save_freq)`, killed at one step and run again.

    python resume.py OUT_DIR INPUT [--kill-at STEP] [--kill-rank R] [--during-save] [--save-freq K]
                     [--notice-at STEP --notice-to launcher|self] [--no-backup] [--step-seconds S]
                     [--record-samples] [--callback-state] [--shard optimizer|weights|weights-at-creation]

INPUT: arrays (shuffle=True), tf_data (a map with per-element work), py_dataset or
data_loader (shuffle=True). 96 samples, batch 4 per replica, 3 epochs, a Dropout (its
random state is restored too) and a metric. The chief appends each step it trains to
a steps file (`epoch step`), and the final weights and the epochs' logged loss go to
OUT_DIR/result.npz. With --kill-at, rank R (default 0) is SIGKILLed after global step
STEP, on the job's first attempt only (a rerun by the launcher or the test goes on),
once the backups begun before it are on disk;
steps go to OUT_DIR/steps.first on that attempt, OUT_DIR/steps.rerun on the next;
with --during-save, inside the commit of the backup that step makes (in its writing
thread: its weights written under their temporary name, not yet renamed). With --notice-at, rank R sends SIGTERM after
that step instead, to the launcher or to itself, and writes the time to OUT_DIR/notice.
--no-backup leaves the script without a BackupAndRestore (`--backup-dir` gives one);
--step-seconds slows each step, so that a notice meets a step still to come. With
--record-samples (PyTorch: a layer's call runs at every step), each rank appends the
sample ids it trains to OUT_DIR/samples.ATTEMPT.RANK, a line `epoch step id id ...` a step.
With --callback-state, a `ModelCheckpoint(save_best_only=True)` whose monitor gets worse
(the loss, mode "max": its best is the first epoch) writes OUT_DIR/best.weights.h5, and a
callback of the script's keeps its own state (`get_state`/`set_state`: the epochs it saw),
a `CSVLogger` writes OUT_DIR/log.csv and a `TensorBoard` OUT_DIR/tensorboard (every step);
result.npz also holds the best checkpoint's weights (`best_*`) and that count.
--shard compiles with keras_dist's sharded optimizer state (and weights; weights-at-creation
builds the model in keras_dist.split_weights()).
"""

import argparse
import json
import os
import signal
import time

import keras
import numpy as np

import keras_dist
from keras_dist.fault_tolerance import background_writes

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("input", choices=["arrays", "tf_data", "py_dataset", "data_loader"])
parser.add_argument("--kill-at", type=int)
parser.add_argument("--kill-rank", type=int, default=0)
parser.add_argument("--during-save", action="store_true")
parser.add_argument("--save-freq", type=int, default=5)
parser.add_argument("--notice-at", type=int)
parser.add_argument("--notice-to", choices=["launcher", "self"], default="self")
parser.add_argument("--no-backup", action="store_true")
parser.add_argument("--step-seconds", type=float, default=0.0)
parser.add_argument("--record-samples", action="store_true")
parser.add_argument("--callback-state", action="store_true")
parser.add_argument("--shard", choices=["optimizer", "weights", "weights-at-creation"])
args = parser.parse_args()

ctx = keras_dist.init()
first_attempt = os.environ.get("KERAS_DIST_RESTART", "0") == "0" and not any(
    os.path.exists(os.path.join(args.out, name)) for name in ("killed", "notice"))

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 6)).astype("float32")
y = (x @ rng.normal(size=(6, 1)) > 0).astype("float32")
batch_size = 4


def make_input():
    if args.input == "arrays":
        return {"x": x, "y": y, "shuffle": True}
    if args.input == "tf_data":
        import tensorflow as tf

        def work(features, label):  # per-element work the resume must not need to repeat
            return tf.math.sin(features) + features, label

        return {"x": tf.data.Dataset.from_tensor_slices((x, y)).map(work).batch(batch_size)}
    if args.input == "py_dataset":
        class Batches(keras.utils.PyDataset):
            def __len__(self):
                return len(x) // (batch_size * ctx.num_replicas) * ctx.num_replicas

            def __getitem__(self, i):
                return x[i * batch_size:(i + 1) * batch_size], y[i * batch_size:(i + 1) * batch_size]

        return {"x": Batches(), "shuffle": True}
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    return {"x": DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=batch_size,
                            shuffle=True)}


class Steps(keras.callbacks.Callback):
    """Logs each step trained, and kills this rank where the test asks."""

    def __init__(self):
        super().__init__()
        self.epoch = self.batch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.batch = batch

    def on_train_batch_end(self, batch, logs=None):
        global_step = self.epoch * self.params["steps"] + batch + 1
        if ctx.is_chief:
            with open(os.path.join(args.out, "steps." + ("first" if first_attempt else "rerun")), "a") as f:
                f.write(f"{self.epoch} {batch}\n")
        if first_attempt and args.kill_at and not args.during_save:
            # The backups begun so far are on disk before a kill, on every rank: this
            # rank's before the next step, and so the chief's before a peer's kill there.
            # (A kill during a backup's write: --during-save.)
            background_writes.wait_for_all()
            if global_step == args.kill_at and ctx.rank == args.kill_rank:
                kill()
        if first_attempt and global_step == args.notice_at and ctx.rank == args.kill_rank:
            with open(os.path.join(args.out, "notice"), "w") as f:
                f.write(str(time.time()))
            target = int(os.environ["KERAS_DIST_LAUNCHER_PID"]) if args.notice_to == "launcher" else os.getpid()
            os.kill(target, signal.SIGTERM)
        time.sleep(args.step_seconds)


def kill():
    open(os.path.join(args.out, "killed"), "w").close()
    os.kill(os.getpid(), signal.SIGKILL)


class RecordSamples(keras.layers.Layer):
    """Appends the ids of the samples of each training step (PyTorch runs it eagerly)."""

    def call(self, inputs, training=None):
        if training and inputs.device.type != "meta":
            ids = [int(np.argmin(np.abs(x[:, 0] - value))) for value in inputs[:, 0].detach().cpu().numpy()]
            name = f"samples.{'first' if first_attempt else 'rerun'}.{ctx.rank}"
            with open(os.path.join(args.out, name), "a") as f:
                f.write(f"{steps.epoch} {steps.batch} {' '.join(map(str, ids))}\n")
        return inputs


keras.utils.set_random_seed(3)
steps = Steps()
def build() -> keras.Model:
    return keras.Sequential([keras.Input((6,)), *([RecordSamples()] if args.record_samples else []),
                             keras.layers.Dense(16, activation="relu"), keras.layers.Dropout(0.3),
                             keras.layers.Dense(1, activation="sigmoid")])


if args.shard == "weights-at-creation":
    with keras_dist.split_weights():
        model = build()
else:
    model = build()
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"],
                   **({"shard": args.shard} if args.shard in ("optimizer", "weights") else {}))
backup = keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=args.save_freq)
if args.during_save and first_attempt and ctx.is_chief:
    from keras_dist.fault_tolerance import atomic_writes

    publish = atomic_writes.publish

    def publish_or_die(partial, final):
        """Dies in the backup's commit (in its writing thread), the weights written but not yet renamed."""
        if os.path.basename(final) == "latest.weights.h5":
            with open(os.path.join(os.path.dirname(final), "training_metadata.json.keras_dist-staged")) as f:
                saved = json.load(f)
            if saved["epoch"] * steps.params["steps"] + saved["batch"] + 1 == args.kill_at:
                kill()
        publish(partial, final)

    atomic_writes.publish = publish_or_die



class EpochsSeen(keras.callbacks.Callback):
    """A script's callback with state of its own, which it saves and restores through keras_dist."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_epoch_end(self, epoch, logs=None):
        self.count += 1

    def get_state(self):
        return {"count": self.count}

    def set_state(self, state):
        self.count = state["count"]


callbacks = [steps] if args.no_backup else [backup, steps]
seen = EpochsSeen()
best_path = os.path.join(args.out, "best.weights.h5")
if args.callback_state:
    callbacks += [keras.callbacks.ModelCheckpoint(best_path, monitor="loss", mode="max", save_best_only=True,
                                                  save_weights_only=True), seen,
                  keras.callbacks.CSVLogger(os.path.join(args.out, "log.csv")),
                  keras.callbacks.TensorBoard(os.path.join(args.out, "tensorboard"), update_freq=1, write_graph=False)]
history = model.fit(**make_input(), batch_size=None if args.input in ("tf_data", "py_dataset", "data_loader")
                    else batch_size, epochs=3, verbose=0, callbacks=callbacks)
final = [np.asarray(w) for w in model.get_weights()]
extra = {}
if args.callback_state:
    model.load_weights(best_path)  # right after fit, on every rank
    extra = {"epochs_seen": np.asarray(seen.count), **{f"best_{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}}
if ctx.is_chief:
    np.savez(os.path.join(args.out, "result.npz"), *final, loss=np.asarray(history.history["loss"]), **extra)
