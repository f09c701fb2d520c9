"""One timed training run for bench/run.py; prints one JSON line with samples/s.

    python worker.py MODE MODEL EPOCHS STEPS

MODE: plain (Keras fit), keras_dist (keras_dist.compile + fit, on the backend the
launcher implies), handwritten (a tf.function step with Horovod's grouped_allreduce on the
gradients), handwritten_mwms (a tf.function step run by MultiWorkerMirroredStrategy, whose
Keras optimizer all-reduces the gradients). With several processes each reports; run.py
sums samples/s over them. Epoch 0 is warm-up (tracing).
"""

import json
import sys
import time

import numpy as np

mode, model_name, epochs, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
if mode == "keras_dist":
    import keras_dist
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

if mode == "handwritten_mwms":  # collective ops must be configured before any TF op runs
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

MODELS = {
    # name: (input shape, per-replica batch, layers)
    "cnn": ((32, 32, 3), 64, lambda: [
        keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Conv2D(64, 3, activation="relu"),
        keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
        keras.layers.Flatten(), keras.layers.Dense(172, activation="relu"), keras.layers.Dense(10)]),
    "mlp": ((784,), 128, lambda: [
        keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)]),
    # A 12.8 MB table (100000 x 32 floats) looked up by 4 ids per example: parameter-server territory.
    "emb": ((4,), 128, lambda: [
        keras.layers.Embedding(EMBEDDING_ROWS, 32), keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(10)]),
}
EMBEDDING_ROWS = 100000
shape, batch, layers = MODELS[model_name]


def build():
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input(shape, dtype="int32" if model_name == "emb" else "float32"), *layers()])


def data(count):
    rng = np.random.default_rng(0)
    x = rng.integers(0, EMBEDDING_ROWS, (count, *shape)).astype("int32") if model_name == "emb" else \
        rng.random((count, *shape), dtype=np.float32)
    return x, rng.integers(0, 10, count).astype("int32")


loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
epoch_seconds = []


class EpochTimer(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        epoch_seconds.append(time.perf_counter() - self.start)


if mode in ("plain", "keras_dist"):
    model = build()
    if mode == "plain":
        rank, size = 0, 1
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss=loss_fn)
    else:
        ctx = keras_dist.init()
        rank, size = ctx.rank, ctx.size
        keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.01), loss=loss_fn)
    x, y = data(steps * batch * size)
    model.fit(x, y, batch_size=batch, epochs=epochs, shuffle=False, verbose=0, callbacks=[EpochTimer()])
elif mode == "handwritten_mwms":
    rank, size = strategy.cluster_resolver.task_id, strategy.cluster_resolver.cluster_spec().num_tasks("worker")
    with strategy.scope():
        model = build()
        optimizer = keras.optimizers.SGD(0.01)
        optimizer.build(model.trainable_variables)
    x, y = data(steps * batch * size)
    # Each worker feeds its interleaved shard, whole batches per replica, as keras_dist does.
    dataset = strategy.distribute_datasets_from_function(
        lambda _: tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(batch).prefetch(2))

    @tf.function
    def train_step(iterator):
        def step(xb, yb):
            with tf.GradientTape() as tape:
                loss = loss_fn(yb, model(xb, training=True))  # Keras divides it by the replica count
            optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return loss

        # Like the logs of a Keras step, the loss is reduced over replicas every step.
        return strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(step, args=next(iterator)), axis=None)

    for _ in range(epochs):
        start = time.perf_counter()
        iterator = iter(dataset)
        for _ in range(steps):
            loss = train_step(iterator)
        float(loss)  # wait for the last step
        epoch_seconds.append(time.perf_counter() - start)
else:
    import horovod.tensorflow as hvd

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    model = build()
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build(model.trainable_variables)
    for i, v in enumerate(model.weights):
        v.assign(hvd.broadcast(v.value, root_rank=0, name=f"bcast{i}"))
    x, y = data(steps * batch * size)
    dataset = tf.data.Dataset.from_tensor_slices((x[rank::size], y[rank::size])).batch(batch).prefetch(2)

    @tf.function
    def train_step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = hvd.grouped_allreduce(tape.gradient(loss, model.trainable_variables), op=hvd.Average)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    for _ in range(epochs):
        start = time.perf_counter()
        for xb, yb in dataset:
            loss = train_step(xb, yb)
        float(loss)  # wait for the last step
        epoch_seconds.append(time.perf_counter() - start)

timed = epoch_seconds[1:]
print("BENCH " + json.dumps({"rank": rank, "size": size, "params": model.count_params(),
                             "samples_per_s": [steps * batch / s for s in timed]}), flush=True)
