"""Trains a small CNN in each precision policy and saves what it ended with, for tests/gpu.

    python gpu_worker.py OUT_DIR --batch B [--plain]

Without `--plain` the script has the two-line change (`import keras_dist`,
`keras_dist.compile`); with it, plain Keras. Each policy (float32, mixed_bfloat16,
mixed_float16) trains a fresh model on the same 512 synthetic images, unshuffled, so
that two processes at batch B see each global batch of one process at 2B. Writes
OUT_DIR/result-<rank>.npz: per policy the weights, the losses, and the devices of the
first kernel and of the optimizer's step counter.
"""

import argparse
import json
import os

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--plain", action="store_true")
args = parser.parse_args()

import keras  # noqa: E402
import numpy as np  # noqa: E402

if not args.plain:
    import keras_dist

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 16, 16, 3)).astype("float32")
y = (x.mean(axis=(1, 2)) @ rng.normal(size=(3, 4))).argmax(axis=1).astype("int32")


def device_of(variable):
    value = variable.value
    if keras.backend.backend() == "jax":
        return ",".join(sorted(str(d) for d in value.devices()))
    return str(value.device)


def train(policy):
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(1)
    model = keras.Sequential([
        keras.Input((16, 16, 3)), keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(16, activation="relu"), keras.layers.Dense(4),
        keras.layers.Activation("linear", dtype="float32"),  # logits in float32, as Keras's guide advises
    ])
    compile_model = model.compile if args.plain else lambda **kw: keras_dist.compile(model, **kw)
    # mixed_float16: Keras wraps the optimizer in a LossScaleOptimizer.
    compile_model(optimizer=keras.optimizers.SGD(0.1), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = model.fit(x, y, batch_size=args.batch, epochs=2, shuffle=False, verbose=0)
    return {"weights": [np.asarray(keras.ops.convert_to_numpy(w), dtype="float64") for w in model.weights],
            "loss": history.history["loss"],
            "kernel_device": device_of(model.layers[0].kernel), "step_device": device_of(model.optimizer.iterations),
            "compute_dtype": model.layers[0].compute_dtype}


rank = 0 if args.plain else keras_dist.current().rank
results = {policy: train(policy) for policy in POLICIES}
arrays = {f"{policy}/{i}": w for policy, result in results.items() for i, w in enumerate(result.pop("weights"))}
np.savez(os.path.join(args.out, f"result-{rank}.npz"), summary=json.dumps(results), **arrays)
