"""One measured run for bench/run.py; every process prints one `BENCH {json}` line.

    python worker.py MODE MODEL --window SECONDS --windows K [--sync DIR] [--data DIR]

MODE:
  plain             Keras `fit`
  keras_dist        the two-line change (`import keras_dist`, `keras_dist.compile`), the
                    same `fit`, on the backend the launcher implies
  handwritten       a tf.function step with Horovod's grouped_allreduce on the gradients;
                    each rank feeds its own shard (tf.data: its files, files[rank::size])
  handwritten_per_tensor  the same with one Horovod allreduce per gradient tensor, as
                    `hvd.DistributedGradientTape` does (the tape fails on Keras 3, horovod#4290)
  handwritten_mwms  a tf.function step run by MultiWorkerMirroredStrategy, whose Keras
                    optimizer all-reduces the gradients; each worker feeds its own shard
  input_plain       no model: iterates the tf.data pipeline, the whole of it
  input_keras_dist  no model: iterates `keras_dist.distribute_dataset(pipeline,
                    training=True)`, this worker's share as `fit` consumes it, once
                    Horovod has stopped (its background thread is not input work)
MODEL: cnn, mlp, emb (NumPy arrays, STEPS batches per process and epoch, unshuffled) or
jpeg_small, jpeg_cnn (the tf.data pipeline of tfdata.py over the files in --data, built
unsharded; `fit` runs whole epochs of it). The input modes ignore MODEL.

BENCH_TF_PROFILE=DIR traces epochs 2 and 3 of `fit` with TensorFlow's profiler into DIR
(bench/tf_timeline.py reads it).

Measuring is bench/windows.py's: after a warm-up epoch, whole epochs fill windows of at
least --window seconds, --windows of them; processes that train together close their
windows at the same epoch (rank 0 decides, through files in --sync). The input modes need
no agreement.

Samples per epoch of a training process are its share: STEPS x batch for arrays,
tfdata.EXAMPLES / processes for tf.data (whole batches either way). They are not read
from the optimizer's step counter: Keras counts one step too many per epoch on a dataset
of unknown length (the step that finds the input exhausted). The input modes count the
elements they actually iterate.
"""

import argparse
import os

import numpy as np

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["plain", "keras_dist", "handwritten", "handwritten_per_tensor",
                                     "handwritten_mwms", "input_plain", "input_keras_dist"])
parser.add_argument("model")
parser.add_argument("--window", type=float, required=True, help="seconds a window lasts at least")
parser.add_argument("--windows", type=int, required=True, help="windows to measure")
parser.add_argument("--sync", help="directory where rank 0 leaves its window decisions")
parser.add_argument("--data", help="directory of the TFRecord files (tf.data models)")
args = parser.parse_args()
mode = args.mode

if mode in ("keras_dist", "input_keras_dist"):
    import keras_dist
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tfdata  # noqa: E402  (beside this file)
from models import CNN_BATCH, CNN_INPUT, CNN_STEPS, cnn_layers  # noqa: E402
from windows import Windows  # noqa: E402

if mode == "handwritten_mwms":  # collective ops must be configured before any TF op runs
    strategy = tf.distribute.MultiWorkerMirroredStrategy()


EMBEDDING_ROWS = 100000
MODELS = {
    # name: (input shape, per-replica batch, layers, batches per process and epoch; None: the tf.data pipeline)
    "cnn": (CNN_INPUT, CNN_BATCH, cnn_layers, CNN_STEPS),
    "mlp": ((784,), 128, lambda: [
        keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)],
        60),
    # A 12.8 MB table (100000 x 32 floats) looked up by 4 ids per example: parameter-server territory.
    "emb": ((4,), 128, lambda: [
        keras.layers.Embedding(EMBEDDING_ROWS, 32), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)],
        100),
    # Input-bound: one small convolution, then pooling; decoding the JPEGs dominates.
    "jpeg_small": ((tfdata.CROP, tfdata.CROP, 3), tfdata.BATCH, lambda: [
        keras.layers.Conv2D(8, 3, activation="relu"), keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(10)],
        None),
    # Compute-bound: the same input feeding the CNN.
    "jpeg_cnn": ((tfdata.CROP, tfdata.CROP, 3), tfdata.BATCH, cnn_layers, None),
}


if mode.startswith("input_"):
    dataset = tfdata.pipeline(args.data)
    rank, size = 0, 1
    if mode == "input_keras_dist":
        ctx = keras_dist.init()
        rank, size = ctx.rank, ctx.size
        dataset = keras_dist.distribute_dataset(dataset, training=True)
        if ctx.name == "horovod":
            # The shards are agreed on; Horovod's idle background thread (8-10% of a core,
            # measured) is not input work, and the one-process figure has no such thread.
            import horovod.tensorflow as hvd

            hvd.shutdown()
    windows = Windows(rank, None, args.window, args.windows)
    done = False
    while not done:
        samples = 0
        for x, _ in dataset:
            samples += int(x.shape[0])
        done = windows.epoch_end(samples)
    windows.report(size, 0)
    raise SystemExit(0)

shape, batch, layers, steps = MODELS[args.model]
tf_data = steps is None


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape, dtype="int32" if args.model == "emb" else "float32"), *layers()])


def arrays(count):
    rng = np.random.default_rng(0)
    x = rng.integers(0, EMBEDDING_ROWS, (count, *shape)).astype("int32") if args.model == "emb" else \
        rng.random((count, *shape), dtype=np.float32)
    return x, rng.integers(0, 10, count).astype("int32")


def local_dataset(rank, size):
    """This process's own shard, for the hand-written loops."""
    if tf_data:
        return tfdata.pipeline(args.data, shard=(size, rank))
    x, y = arrays(steps * batch * size)
    # Untuned, as keras_dist's own array pipeline is: the end of an autotuned iterator waits
    # for its tuning thread at every epoch (bench/results/2026-11-28-cpu-2core-epoch-start.md),
    # which would measure tf.data, not the loop.
    options = tf.data.Options()
    options.autotune.enabled = False
    dataset = tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(batch).prefetch(2)
    return dataset.with_options(options)


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# The windows of a profiled run include the profiler's cost: read its timeline, not its samples/s.
PROFILE = os.environ.get("BENCH_TF_PROFILE")
PROFILED_EPOCHS = (2, 3)


def samples_per_epoch(size):
    """What one of `size` processes trains on per epoch."""
    return tfdata.EXAMPLES // size if tf_data else steps * batch


class Measure(keras.callbacks.Callback):
    """Epoch hooks only: a batch hook would make Keras (and keras_dist) produce batch logs."""

    def __init__(self, windows, samples):
        super().__init__()
        self.windows, self.samples = windows, samples

    def on_epoch_begin(self, epoch, logs=None):
        if PROFILE and epoch == PROFILED_EPOCHS[0]:
            tf.profiler.experimental.start(PROFILE)

    def on_epoch_end(self, epoch, logs=None):
        if PROFILE and epoch == PROFILED_EPOCHS[1]:
            tf.profiler.experimental.stop()
        if self.windows.epoch_end(self.samples):
            self.model.stop_training = True


if mode in ("plain", "keras_dist"):
    model = build()
    if mode == "plain":
        rank, size = 0, 1
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn)
    else:
        keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.01), loss=loss_fn,
                           gradient_compression=os.environ.get("BENCH_COMPRESSION") or None)
        rank, size = keras_dist.current().rank, keras_dist.current().size
    windows = Windows(rank, args.sync, args.window, args.windows)
    fit_args = dict(epochs=100000, verbose=0, callbacks=[Measure(windows, samples_per_epoch(size))])
    if tf_data:
        model.fit(tfdata.pipeline(args.data), **fit_args)
    else:
        x, y = arrays(steps * batch * size)
        model.fit(x, y, batch_size=batch, shuffle=False, **fit_args)
elif mode == "handwritten_mwms":
    rank, size = strategy.cluster_resolver.task_id, strategy.cluster_resolver.cluster_spec().num_tasks("worker")
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    local_steps = samples_per_epoch(size) // batch
    dataset = strategy.distribute_datasets_from_function(lambda _: local_dataset(rank, size))

    @tf.function
    def train_step(iterator):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))  # Keras divides it by the replica count
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        # Like the logs of a Keras step, the loss is reduced over replicas every step.
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=next(iterator)), axis=None)

    windows = Windows(rank, args.sync, args.window, args.windows)
    done = False
    while not done:
        iterator = iter(dataset)
        for _ in range(local_steps):
            loss = train_step(iterator)
        float(loss)  # wait for the last step
        done = windows.epoch_end(samples_per_epoch(size))
else:
    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    for i, v in enumerate(model.weights):
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"bcast{i}"))
    dataset = local_dataset(rank, size)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        if mode == "handwritten_per_tensor":
            grads = [hvd.allreduce(g, op=hvd.Average) for g in grads]
        else:
            grads = hvd.grouped_allreduce(grads, op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    windows = Windows(rank, args.sync, args.window, args.windows)
    done = False
    while not done:
        for xb, yb in dataset:
            loss = train_step(xb, yb)
        float(loss)  # wait for the last step
        done = windows.epoch_end(samples_per_epoch(size))

windows.report(size, model.count_params())
