"""What `keras_dist.compiled_elsewhere.CompiledElsewhereWatch` costs a PyTorch train step (eager: every
layer call asks Keras's global distribution for an output layout).

    KERAS_BACKEND=torch python bench/guard_overhead.py [WINDOW_SECONDS] [WINDOWS]

One process, a 32-layer MLP at batch 32, `train_on_batch` in windows of WINDOW_SECONDS (20)
alternating no distribution / the guard set, WINDOWS (6) of each; prints the median CPU
seconds per step of each and their ratio.
"""

import sys
import time

import keras
import numpy as np

from keras_dist.strategies.single import SingleProcessStrategy
from keras_dist.compiled_elsewhere import CompiledElsewhereWatch

window_seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 20.0
windows = int(sys.argv[2]) if len(sys.argv) > 2 else 6
model = keras.Sequential([keras.Input((64,)), *[keras.layers.Dense(64, activation="relu") for _ in range(31)],
                          keras.layers.Dense(1)])
model.compile(optimizer="sgd", loss="mse")
rng = np.random.default_rng(0)
x, y = rng.random((32, 64), dtype=np.float32), rng.random((32, 1), dtype=np.float32)
model.train_on_batch(x, y)
guard = CompiledElsewhereWatch(SingleProcessStrategy())
per_step = {"plain": [], "guard": []}
for _ in range(windows):
    for name, distribution in (("plain", None), ("guard", guard)):
        keras.distribution.set_distribution(distribution)
        steps, cpu, end = 0, time.process_time(), time.monotonic() + window_seconds
        while time.monotonic() < end:
            model.train_on_batch(x, y)
            steps += 1
        per_step[name].append((time.process_time() - cpu) / steps)
keras.distribution.set_distribution(None)
medians = {name: float(np.median(values)) for name, values in per_step.items()}
print(f"keras {keras.__version__} {keras.backend.backend()}: CPU s/step median plain {medians['plain']:.5f}, "
      f"guard {medians['guard']:.5f}, guard/plain {medians['guard'] / medians['plain']:.3f} "
      f"({windows} windows of {window_seconds:g} s each, alternated)")
