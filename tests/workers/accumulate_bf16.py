"""Adam accumulating gradients over 2 steps, under the mixed_bfloat16 policy, on 2 processes.

    python accumulate_bf16.py RESULT_JSON none|optimizer|weights

Trains 2 epochs of 8 steps (batch 8 a process) and has the chief write the epochs' losses
and the final weights to RESULT_JSON.
"""

import json
import sys

import keras
import numpy as np

import keras_dist

context = keras_dist.init()
keras.config.set_dtype_policy("mixed_bfloat16")
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)])
shard = None if sys.argv[2] == "none" else sys.argv[2]
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.01, gradient_accumulation_steps=2), loss="mse",
                   shard=shard)
x = np.random.default_rng(0).normal(size=(64 * context.size, 6)).astype("float32")
history = model.fit(x, x[:, :2] * 2, batch_size=8, epochs=2, verbose=0, shuffle=False)
if context.is_chief:
    with open(sys.argv[1], "w") as f:
        json.dump({"loss": history.history["loss"],
                   "weights": [np.asarray(w, "float32").tolist() for w in model.get_weights()]}, f)
