"""A script shaped like Keras's built-in training guide on JAX: several small models, each
compiled, fit with validation, evaluated and asked to predict (per-call overhead, not
steady-state throughput). Run by bench/guide_overhead.py; prints its wall time last.

    python bench/guide_script.py [SECTIONS]
"""

import os
import sys
import time

import keras
import numpy as np

import keras_dist
from keras_dist import environments

SECTIONS = int(sys.argv[1]) if len(sys.argv) > 1 else 5
batch = 64 // environments.detect(os.environ).size  # a global batch of 64
rng = np.random.default_rng(0)
x, y = rng.normal(size=(6000, 784)).astype("float32"), rng.integers(0, 10, 6000)
start = time.perf_counter()
for _ in range(SECTIONS):
    inputs = keras.Input((784,))
    hidden = keras.layers.Dense(64, activation="relu")(keras.layers.Dense(64, activation="relu")(inputs))
    model = keras.Model(inputs, keras.layers.Dense(10, activation="softmax")(hidden))
    keras_dist.compile(model, optimizer=keras.optimizers.RMSprop(), loss="sparse_categorical_crossentropy",
                       metrics=[keras.metrics.SparseCategoricalAccuracy()])
    model.fit(x, y, batch_size=batch, epochs=2, validation_data=(x[:1000], y[:1000]), verbose=0)
    model.evaluate(x[:1000], y[:1000], batch_size=128, verbose=0)
    model.predict(x[:3], verbose=0)
print(f"seconds {time.perf_counter() - start:.2f}", flush=True)
