"""tf.data pipelines as users write them, trained with the two-line change under any launcher.

    python input_pipeline.py OUT_DIR FILES_DIR

FILES_DIR holds TFRecord files written by the test: each record is the
int64 id of one example. Every pipeline's map logs, through `tf.py_function`, the ids it
preprocesses in this process, so the test sees which elements each worker's pipeline
worked on. Writes OUT_DIR/input.<rank>.json.
"""

import glob
import json
import os
import sys

import numpy as np
import keras
import tensorflow as tf

import keras_dist

out_dir, files_dir = sys.argv[1], sys.argv[2]
ctx = keras_dist.init()
files = sorted(glob.glob(os.path.join(files_dir, "*.tfrecord")))
mapped = []  # ids this process's pipeline preprocessed, in order


def log_id(i):
    mapped.append(int(i))
    return i


def features(i):
    """The per-element work: logged, then turned into an (x, y) example."""
    i = tf.py_function(log_id, [i], tf.int64)
    i.set_shape([])
    x = tf.stack([tf.cast(i % 7, tf.float32), tf.cast(i % 3, tf.float32)])
    return x, tf.cast(i % 2, tf.float32)


def parse(record):
    return tf.io.decode_raw(record, tf.int64)[0]


class LogEpochOnly(keras.callbacks.Callback):
    # Under a tf.distribute strategy Keras builds the model from a first batch of an
    # iterator it then drops (its `_maybe_symbolic_build`): not part of the epoch.
    def on_train_begin(self, logs=None):
        mapped.clear()


def fit(dataset):
    """Trains one epoch; returns the ids mapped in it and the loss."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    keras_dist.compile(model, optimizer="sgd", loss="mse")
    history = model.fit(dataset, epochs=1, verbose=0, callbacks=[LogEpochOnly()])
    return {"mapped": list(mapped), "loss": history.history["loss"]}


def rank_seeded(make_dataset):
    """A dataset made under a per-worker global seed, as some Horovod scripts seed."""
    tf.random.set_seed(ctx.rank)
    dataset = make_dataset()
    tf.random.set_seed(None)
    return dataset


def replica_input():
    """What a strategy's replicas read from a share of equal steps (keras_dist padded it) and
    from one of unequal steps: under MultiWorkerMirrored the first is the worker's pipeline
    itself (one replica on the host), the second TensorFlow's distributed dataset, whose
    end agrees across workers."""
    from keras_dist.inputs.base import mark_equal_steps

    strategy = ctx.strategy if ctx.name == "multi_worker_mirrored" else tf.distribute.get_strategy()
    equal, unequal = tf.data.Dataset.range(8).batch(2), tf.data.Dataset.range(8).batch(2)
    mark_equal_steps(equal)
    return {name: "tf.data.Dataset" if isinstance(read, tf.data.Dataset) else type(read).__name__
            for name, read in (("equal", strategy.experimental_distribute_dataset(equal)),
                               ("unequal", strategy.experimental_distribute_dataset(unequal)))}


def error_of(call):
    try:
        call()
    except keras_dist.KerasDistError as exc:
        return str(exc)
    return None


def bad_inputs():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    keras_dist.compile(model, optimizer="sgd", loss="mse")
    examples = tf.data.Dataset.range(64).map(features)
    return {
        "infinite": error_of(lambda: model.fit(examples.batch(8).repeat(), epochs=1, verbose=0)),
        "unbatched": error_of(lambda: model.fit(examples, epochs=1, verbose=0)),
        "empty_arrays": error_of(lambda: model.fit(np.zeros((0, 2)), np.zeros((0,)), epochs=1, verbose=0)),
    }


if __name__ == "__main__":
    results = {
        "elements": fit(tf.data.Dataset.range(250).map(features, num_parallel_calls=tf.data.AUTOTUNE)
                        .batch(8).prefetch(tf.data.AUTOTUNE)),
        "seeded_shuffle": fit(tf.data.Dataset.range(250).shuffle(100, seed=4).map(features).batch(8)),
        "unseeded_shuffle": fit(tf.data.Dataset.range(250).shuffle(100).map(features).batch(8)),
        # keras_dist moves the shuffle ahead of the map: still only the share is mapped.
        "unseeded_shuffle_after_map": fit(tf.data.Dataset.range(250).map(features).shuffle(250).batch(8)),
        "rank_seeded_shuffle": fit(rank_seeded(lambda: tf.data.Dataset.range(250).shuffle(100).map(features).batch(8))),
        "files": fit(tf.data.TFRecordDataset(files).map(parse).map(features).batch(8)),
        "listed_files": fit(tf.data.Dataset.list_files(os.path.join(files_dir, "*.tfrecord"))
                            .interleave(tf.data.TFRecordDataset, num_parallel_calls=2).map(parse).map(features)
                            .batch(8)),
        "one_file": fit(tf.data.TFRecordDataset(files[0]).map(parse).map(features).batch(8)),
        "filtered": fit(tf.data.Dataset.range(250).filter(lambda i: i % 5 > 0).map(features).batch(8)),
        "bad_inputs": bad_inputs(),
        "replica_input": replica_input(),
        # A loop of the script's own: the share of 10 elements in batches of 2, padded (training) or not.
        "distribute_dataset": {str(training): [b.tolist() for b in keras_dist.distribute_dataset(
            tf.data.Dataset.range(10).batch(2), training=training).as_numpy_iterator()] for training in (True, False)},
        # One process's order of the seeded shuffle above (it depends on the global seed).
        "one_process_order": [int(i) for i in tf.data.Dataset.range(250).shuffle(100, seed=4).as_numpy_iterator()],
    }
    with open(os.path.join(out_dir, f"input.{ctx.rank}.json"), "w") as f:
        json.dump(results, f)
