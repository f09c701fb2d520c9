"""What the pattern workers share (published_patterns.py and keras_guides.py): the one
line a script changes, their data, and running the named patterns (imports no framework)."""

import os
import pickle
import sys
import time

import numpy as np

import keras_dist


def compile_for(mode):
    """The one line the two-line change touches: `model.compile` in a plain run, else `keras_dist.compile`."""
    def compile(model, **kwargs):
        if mode == "plain":
            model.compile(**kwargs)
        else:
            keras_dist.compile(model, **kwargs)
    return compile


def classification_data(count, seed=0):
    """`count` inputs of 6 features and their integer labels (3 classes)."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 6)).astype("float32")
    y = np.argmax(x[:, :3] + 0.5 * x[:, 3:], axis=1).astype("int32")
    return x, y


def data_of(default_count):
    """`classification_data` with a worker's own default sample count."""
    def data(count=default_count, seed=0):
        return classification_data(count, seed)
    return data


def run_patterns(namespace, names, out_dir, rank):
    """Calls `namespace["pattern_" + name]()` for each name; writes OUT_DIR/NAME.RANK.pkl.

    A pattern keras_dist refuses stores {"refused": message}.
    """
    for name in names:
        start = time.perf_counter()
        try:
            out = namespace[f"pattern_{name}"]()
        except keras_dist.KerasDistError as exc:
            out = {"refused": str(exc)}
        with open(os.path.join(out_dir, f"{name}.{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
        print(f"pattern {name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
