"""Scripts the fault tests run, as a user's script would be.

    python faults.py save OUT_DIR EPOCHS   # trains a 36 MB model, BackupAndRestore + ModelCheckpoint
    python faults.py idle OUT_DIR          # starts keras_dist, writes its pid, then waits
    python faults.py killed_by_signal      # one rank (or worker) SIGKILLs itself
"""

import os
import signal
import sys
import time

import numpy as np
import keras

import keras_dist

mode = sys.argv[1]
ctx = keras_dist.init()

if mode == "save":
    out_dir, epochs = sys.argv[2], int(sys.argv[3])
    x = np.random.default_rng(0).normal(size=(16, 3000)).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((3000,)), keras.layers.Dense(3000), keras.layers.Dense(1)])
    keras_dist.compile(model, optimizer=keras.optimizers.Adam(1e-4), loss="mse")

    class Report(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            print(f"epoch {epoch} begins", flush=True)

    model.fit(x, x[:, :1], batch_size=16, epochs=epochs, verbose=0, callbacks=[
        keras.callbacks.BackupAndRestore(os.path.join(out_dir, "backup"), delete_checkpoint=False),
        keras.callbacks.ModelCheckpoint(os.path.join(out_dir, "model.keras")),
        Report(),
    ])
    print("finished", flush=True)
elif mode == "idle":
    with open(os.path.join(sys.argv[2], f"pid.{ctx.rank}"), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(600)
elif mode == "killed_by_signal":
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(600)
