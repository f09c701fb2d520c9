"""Counts the all-reduces a PyTorch train step issues, from torch's profiler (real collectives).

    KERAS_BACKEND=torch keras-dist launch -n 2 collectives_per_step.py OUT_DIR

The MLP of issue 41 (256-1024-1024-2, batch 32, SGD): keras_dist all-reduces each gradient
once a step, in buckets. Keras 3.16 also wraps a model in
DistributedDataParallel and all-reduces metric states in every step wherever
torch.distributed is up; keras_dist turns both off per model. Writes
OUT_DIR/result-RANK.json: the elements all-reduced in each step (from one step's start to
the next), the model's parameter count, and whether Keras wrapped the model.
"""

import json
import os
import sys

import keras
import numpy as np
import torch

import keras_dist

out_dir = sys.argv[1]
STEPS = 8
rank = keras_dist.init().rank
rng = np.random.default_rng(0)
x = rng.normal(size=(2 * 32 * STEPS, 256)).astype("float32")
y = rng.integers(0, 2, size=len(x))
model = keras.Sequential([keras.Input((256,)), keras.layers.Dense(1024, activation="relu"),
                          keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(2)])
keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.01),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])


class StepStarts(keras.callbacks.Callback):
    """When each step starts, on the profiler's clock (no batch-end hook: that would make
    keras_dist sum batch logs in every step)."""

    def __init__(self):
        super().__init__()
        self.starts = []

    def on_train_batch_begin(self, batch, logs=None):
        with torch.profiler.record_function("step_start"):
            pass


model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)  # builds and warms up
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0, callbacks=[StepStarts()])
events = sorted(profile.events(), key=lambda event: event.time_range.start)
starts = [event.time_range.start for event in events if event.name == "step_start"]
reduced = [0] * len(starts)  # elements all-reduced in each step
for event in events:
    if event.name.endswith(":all_reduce") and starts[0] <= event.time_range.start < starts[-1]:
        elements = int(np.prod(event.input_shapes[0]))
        if elements > 16:  # not the preemption notice's few flags, which it agrees on every few seconds
            reduced[max(i for i, start in enumerate(starts) if start <= event.time_range.start)] += elements
with open(os.path.join(out_dir, f"result-{rank}.json"), "w") as f:
    json.dump({"reduced_per_step": reduced[:-1], "parameters": int(sum(np.prod(w.shape) for w in model.trainable_weights)),
               "keras_wrapped_ddp": getattr(model, "ddp_model", None) is not None}, f)
