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


def alternating_labels(compile, batch_size, kinds):
    """keras.io's siamese pattern in small (pairs appended same-class then different-class, so
    labels alternate 0, 1, 0, 1, ...): BatchNormalization, then one logistic unit, fit with its
    default shuffle. Returns the last model's result and `evaluate` on the training set per input kind.

    Each replica's batches must be a uniform sample of the data: a fixed stride of it gives
    each of 2 replicas one class, which its batch statistics normalize away (issue 47).
    """
    import keras

    count = 4096
    rng = np.random.default_rng(3)
    y = (np.arange(count) % 2).astype("float32")
    x = (2 * y + rng.normal(size=count)).astype("float32")[:, None]  # one process: about 0.84
    evaluation = {}
    for kind in kinds:
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((1,)), keras.layers.BatchNormalization(),
                                  keras.layers.Dense(1, activation="sigmoid")])
        compile(model, optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
        if kind == "arrays":
            history = model.fit(x, y, batch_size=batch_size, epochs=2, verbose=0)
        elif kind == "tf_data":  # an unseeded shuffle after a map, as tf.data guides write it
            import tensorflow as tf

            tf.random.set_seed(None)  # as in an unseeded script: a seeded shuffle keeps its order across the split
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).map(lambda a, b: (a * 1.0, b)).shuffle(count)
            history = model.fit(dataset.batch(batch_size), epochs=2, verbose=0)
        else:  # a shuffling torch DataLoader
            import torch

            loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y)),
                                                 batch_size=batch_size, shuffle=True)
            history = model.fit(loader, epochs=2, verbose=0)
        evaluation[kind] = model.evaluate(x, y, batch_size=batch_size, verbose=0, return_dict=True)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history, "evaluate": evaluation}


def checkpoint_reload_and_callback_files(compile, batch_size, out_dir, rank):
    """An ensemble trained in a loop, as two keras.io examples do: each member checkpoints its
    best epoch to one shared path (`ModelCheckpoint(save_best_only=True, save_weights_only=True)`)
    and loads it right after `fit`; members differ in shape, so a stale file cannot load.
    Two callbacks of the script's write a line per epoch (a GAN's image monitor, in small):
    one as written, one through `keras_dist.callbacks.chief_only`. Every rank must load the
    best epoch's weights; the chief alone writes the second file (issue 46).
    """
    import logging

    import keras

    class EpochFiles(keras.callbacks.Callback):
        def __init__(self, path):
            super().__init__()
            self.path = path

        def on_epoch_end(self, epoch, logs=None):
            with open(self.path, "a") as f:
                f.write(f"{rank}\n")

    class Epochs(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.seen = []

        def on_epoch_end(self, epoch, logs=None):
            self.seen.append((logs["loss"], [np.array(w) for w in self.model.get_weights()]))

    warnings = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())
    logging.getLogger("keras_dist").addHandler(handler)
    x, y = classification_data(64)
    path = os.path.join(out_dir, "member.weights.h5")
    members = []
    for member in range(2):
        keras.utils.set_random_seed(member)
        model = keras.Sequential([keras.Input((6,)), keras.layers.Dense(4 * (member + 1), activation="tanh"),
                                  keras.layers.Dense(3)])
        compile(model, optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.SparseCategoricalCrossentropy(True))
        epochs = Epochs()
        callbacks = [keras.callbacks.ModelCheckpoint(path, monitor="loss", save_best_only=True, save_weights_only=True),
                     epochs, EpochFiles(os.path.join(out_dir, f"every_rank.{member}.txt")),
                     keras_dist.callbacks.chief_only(EpochFiles(os.path.join(out_dir, f"chief_only.{member}.txt")))]
        history = model.fit(x, y, batch_size=batch_size, epochs=4, shuffle=False, verbose=0, callbacks=callbacks)
        model.load_weights(path)
        members.append({"loaded": model.get_weights(), "best": min(epochs.seen, key=lambda seen: seen[0])[1]})
    logging.getLogger("keras_dist").removeHandler(handler)
    writers = {}
    for name in ("every_rank", "chief_only"):
        with open(os.path.join(out_dir, f"{name}.0.txt")) as f:
            writers[name] = sorted(set(f.read().split()))
    return {"weights": model.get_weights(), "history": history.history, "members": members, "writers": writers,
            "warnings": warnings}


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
