"""Runs the named patterns of a pattern worker and pickles each result (shared by
published_patterns.py and keras_guides.py; imports no framework)."""

import os
import pickle

import keras_dist


def run_patterns(namespace, names, out_dir, rank):
    """Calls `namespace["pattern_" + name]()` for each name; writes OUT_DIR/NAME.RANK.pkl.

    A pattern keras_dist refuses stores {"refused": message}.
    """
    for name in names:
        try:
            out = namespace[f"pattern_{name}"]()
        except keras_dist.KerasDistError as exc:
            out = {"refused": str(exc)}
        with open(os.path.join(out_dir, f"{name}.{rank}.pkl"), "wb") as f:
            pickle.dump(out, f)
