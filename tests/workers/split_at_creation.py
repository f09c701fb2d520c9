"""A model built in `keras_dist.split_weights()` under a memory cap below its weights' bytes:
it builds, trains, saves and loads back (issue 65).

    python split_at_creation.py OUT [--whole] [--headroom-mib M] [--layers L] [--width W]
        [--backup --kill-rank R --kill-after-step K]

Builds L Dense layers of W units (inside `keras_dist.split_weights()` unless --whole) and,
with --headroom-mib, caps this process's data memory (`RLIMIT_DATA`) at what it holds
after the imports plus M MiB. (Run it with a fixed `MALLOC_MMAP_THRESHOLD_`: glibc then
returns large freed buffers at once, so the cap counts what the process holds rather
than heap its allocator keeps after a peak.) Trains 3 steps of 8 samples a process with SGD and
momentum (OUT/initial.weights.h5 written first, before the optimizer is built), writes
OUT/model.weights.h5 (and, uncapped, OUT/model.keras) from every process
(the chief writes), loads the weights file back on every process, writes it again as
OUT/again.weights.h5, and prints "trained WEIGHTS". With --backup a `BackupAndRestore`
saves after every step into OUT/backup, and rank R SIGKILLs itself after step K the
first time (OUT/killed): run under `--max-restarts 1`, the job resumes from the backup.
"""

import argparse
import os
import resource
import signal
import sys

import keras
import numpy as np

import keras_dist

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--whole", action="store_true")
parser.add_argument("--headroom-mib", type=int)
parser.add_argument("--layers", type=int, default=24)
parser.add_argument("--width", type=int, default=1024)
parser.add_argument("--momentum", type=float, default=0.0)
parser.add_argument("--shard", help="passed to keras_dist.compile")
parser.add_argument("--checkpoint", action="store_true", help="a ModelCheckpoint in fit")
parser.add_argument("--backup", action="store_true", help="a BackupAndRestore saving after every step")
parser.add_argument("--kill-rank", type=int)
parser.add_argument("--kill-after-step", type=int)
args = parser.parse_args()


def data_mib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmData:")) // 1024


context = keras_dist.init()
keras.utils.set_random_seed(0)
if args.headroom_mib is not None:
    cap = (data_mib() + args.headroom_mib) * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))



def build() -> keras.Model:
    return keras.Sequential([keras.Input((args.width,)),
                             *[keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers)],
                             keras.layers.Dense(10)])


if args.whole:
    model = build()
else:
    with keras_dist.split_weights():
        model = build()
keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.01, momentum=args.momentum),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   **({"shard": args.shard} if args.shard else {}))
model.save_weights(os.path.join(args.out, "initial.weights.h5"))  # on every process, the optimizer not built
rng = np.random.default_rng(0)
x = rng.normal(size=(3 * 8 * context.size, args.width)).astype("float32")
y = rng.integers(0, 10, size=len(x)).astype("int32")
callbacks = [keras.callbacks.ModelCheckpoint(os.path.join(args.out, "checkpoint.weights.h5"),
                                             save_weights_only=True)] if args.checkpoint else []


class KillOnce(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        killed = os.path.join(args.out, "killed")
        if batch + 1 == args.kill_after_step and context.rank == args.kill_rank and not os.path.exists(killed):
            open(killed, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)


if args.backup:
    callbacks += [keras.callbacks.BackupAndRestore(os.path.join(args.out, "backup"), save_freq=1), KillOnce()]
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0, callbacks=callbacks)
if args.headroom_mib is None:  # a .keras archive: Keras buffers its weights in memory where the machine has room
    model.save(os.path.join(args.out, "model.keras"))
model.save_weights(os.path.join(args.out, "model.weights.h5"))
model.load_weights(os.path.join(args.out, "model.weights.h5"))
model.save_weights(os.path.join(args.out, "again.weights.h5"))
print("trained", model.count_params(), "data MiB", data_mib(), flush=True)
sys.exit(0)
