"""Every way of batching a `tf.data.Dataset` that Keras takes (issue 67), through `fit` under
a launcher, on any Keras backend.

    batched_datasets.py OUT

Each construction's elements become one number in and one out (the mean of the first and of
the last leaf), and a Dense(1) fits them for 2 epochs. Writes `OUT/batched.RANK.json`: per
construction, the steps each epoch ran, the losses and the weights. tests/test_input_pipeline.py
imports `constructions` for its split in one process.
"""

import json
import os
import sys
from pathlib import Path

import numpy as np
import tensorflow as tf


def constructions(directory, batch=4):
    """Every way of batching a dataset that Keras takes (issue 67), over 22 numbered elements,
    in batches of `batch` (a bucket's, a rebatch's half)."""
    import keras
    from PIL import Image

    directory = Path(directory)

    x, y = np.arange(44, dtype="float32").reshape(22, 2), np.arange(22, dtype="float32")
    features, labels = tf.data.Dataset.from_tensor_slices(x).batch(batch), tf.data.Dataset.from_tensor_slices(y).batch(batch)
    numbered = tf.data.Dataset.from_tensor_slices((x, y))
    lengths = tf.data.Dataset.range(1, 23).map(lambda n: (tf.range(n), n))
    for label in ("a", "b"):
        os.makedirs(directory / "images" / label, exist_ok=True)
        os.makedirs(directory / "texts" / label, exist_ok=True)
        for i in range(5):
            Image.fromarray(np.full((4, 4, 3), i * 10 + (label == "b"), np.uint8)).save(directory / "images" / label / f"{i}.png")
            (directory / "texts" / label / f"{i}.txt").write_text(f"{label} {i}")
    return {
        "zip": tf.data.Dataset.zip((features, labels)),
        "zip_prefetch_cache": tf.data.Dataset.zip((features, labels)).prefetch(16).cache(),
        "concatenate": numbered.take(10).batch(batch).concatenate(numbered.skip(10).batch(batch)),
        "map_filter_after_batch": numbered.batch(batch).map(lambda a, b: (a * 2, b)).filter(
            lambda a, b: tf.reduce_min(b) >= 0),
        "dict": tf.data.Dataset.from_tensor_slices(({"a": x}, y)).batch(batch),
        # An in-memory cache: each rewrite in a process (fit's shard, evaluate's) has its own.
        "map_cache": numbered.map(lambda a, b: (a + 1, b)).cache().batch(batch),
        "padded_batch": lengths.padded_batch(batch),
        "bucket_by_sequence_length": lengths.bucket_by_sequence_length(
            lambda e, n: tf.cast(n, tf.int32), [8, 16], [batch] * 3),
        "rebatch": numbered.batch(batch).rebatch(batch // 2),
        "timeseries_zip": tf.data.Dataset.zip((
            keras.utils.timeseries_dataset_from_array(x, None, sequence_length=3, batch_size=batch),
            keras.utils.timeseries_dataset_from_array(y[2:], None, sequence_length=1, batch_size=batch))).prefetch(2).cache(),
        "timeseries_targets": keras.utils.timeseries_dataset_from_array(x, y, sequence_length=3, batch_size=batch),
        "image_dataset_from_directory": keras.utils.image_dataset_from_directory(
            directory / "images", image_size=(4, 4), batch_size=batch, shuffle=False),
        "text_dataset_from_directory": keras.utils.text_dataset_from_directory(
            directory / "texts", batch_size=batch, shuffle=False),
    }


def as_one_number(*element):
    """The mean of the first leaf and of the last one, per batch row, as (x, y)."""
    leaves = tf.nest.flatten(element)

    def mean(leaf):
        leaf = tf.strings.length(leaf) if leaf.dtype == tf.string else leaf
        leaf = tf.cast(leaf, tf.float32)
        return tf.reshape(tf.reduce_mean(tf.reshape(leaf, [tf.shape(leaf)[0], -1]), axis=1), [-1, 1])

    return mean(leaves[0]) / 10.0, mean(leaves[-1]) / 10.0


if __name__ == "__main__":
    import keras

    import keras_dist

    out = sys.argv[1]
    ctx = keras_dist.init()
    report = {}
    for name, dataset in constructions(os.path.join(out, f"data.{ctx.rank}")).items():
        steps = []

        class CountSteps(keras.callbacks.Callback):
            def on_epoch_begin(self, epoch, logs=None):
                steps.append(0)

            def on_train_batch_end(self, batch, logs=None):
                steps[-1] += 1

        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(1)])
        keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.01), loss="mse")
        history = model.fit(dataset.map(as_one_number), epochs=2, verbose=0, callbacks=[CountSteps()])
        report[name] = {"steps": steps, "loss": history.history["loss"],
                        "weights": [np.asarray(w).tolist() for w in model.get_weights()]}
    with open(os.path.join(out, f"batched.{ctx.rank}.json"), "w") as f:
        json.dump(report, f)
