"""What published Keras 3 scripts do, each written here as a small script of our own.

    python published_patterns.py OUT_DIR plain|keras_dist PATTERN [PATTERN ...]

The same script runs as one plain process (`plain`: `model.compile`, no keras_dist) and
with the two-line change (`keras_dist`: `keras_dist.compile`) under any launcher. The
global batch is fixed (GLOBAL_BATCH), so the per-replica batch is GLOBAL_BATCH / replicas;
where a pattern is deterministic, N replicas must end where one plain process does.
Every process starts from its own random weights (seed 100 + rank): keras_dist must
broadcast the chief's.

Each pattern returns a dict (weights, history, evaluate, predict, files...), pickled to
OUT_DIR/PATTERN.RANK.pkl; a pattern keras_dist refuses stores {"refused": message}.
"""

import csv
import os
import sys

import keras
import numpy as np
import tensorflow as tf
from keras import ops, tree

import keras_dist
from pattern_runner import alternating_labels, checkpoint_reload_and_callback_files, compile_for, data_of, run_patterns

OUT_DIR, MODE, NAMES = sys.argv[1], sys.argv[2], sys.argv[3:]
GLOBAL_BATCH = 32
ctx = keras_dist.init() if MODE == "keras_dist" else None
RANK = ctx.rank if ctx else 0
BATCH = GLOBAL_BATCH // (ctx.num_replicas if ctx else 1)
CHIEF = RANK == 0


compile = compile_for(MODE)  # the one line the two-line change touches


data = data_of(96)


def seeded(seed=100):
    keras.utils.set_random_seed(seed + RANK)


def classifier(hidden=8):
    seeded()
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(hidden, activation="tanh", name="hidden"),
                             keras.layers.Dense(3, name="logits")])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def result(model, history, x=None, y=None, **extra):
    out = {"weights": [np.array(w) for w in model.get_weights()], "history": history.history, **extra}
    if x is not None:
        out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return out


# --- patterns -------------------------------------------------------------------------
def pattern_compile_twice():
    """Transfer learning: train the head with the base frozen, unfreeze, compile again, fine-tune."""
    x, y = data()
    model = classifier()
    model.get_layer("hidden").trainable = False
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    model.get_layer("hidden").trainable = True
    compile(model, optimizer=keras.optimizers.Adam(1e-2), loss=loss(), metrics=["accuracy"])
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y)


class TwoOptimizers(keras.Model):
    """A GAN-shaped model: `compile` takes its own optimizers, `train_step` applies both."""

    def __init__(self):
        super().__init__()
        self.body = keras.layers.Dense(8, activation="tanh")
        self.head = keras.layers.Dense(3)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.head(self.body(x))

    def compile(self, body_optimizer, head_optimizer, loss_fn):
        super().compile()
        self.body_optimizer, self.head_optimizer, self.loss_fn = body_optimizer, head_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        x, y = data
        with tf.GradientTape(persistent=True) as tape:
            loss = self.loss_fn(y, self(x, training=True))
        for optimizer, layer in ((self.body_optimizer, self.body), (self.head_optimizer, self.head)):
            optimizer.apply(tape.gradient(loss, layer.trainable_weights), layer.trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def pattern_custom_compile_two_optimizers():
    x, y = data()
    seeded()
    model = TwoOptimizers()
    model(x[:1])
    compile(model, body_optimizer=keras.optimizers.SGD(0.1), head_optimizer=keras.optimizers.Adam(1e-2),
            loss_fn=loss())
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0))


class GuideStep(keras.Model):
    """The custom `train_step` of Keras's "customizing fit" guide: compute_loss, then every metric."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=y_pred)
        self.optimizer.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


def pattern_custom_train_step():
    x, y = data()
    seeded()
    inputs = keras.Input((6,))
    model = GuideStep(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y)


class LabelSum(keras.metrics.Metric):
    """A custom metric whose `result()` is its state variable itself."""

    def __init__(self, name="label_sum", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.sum(ops.cast(y_true, "float32")))

    def result(self):
        return self.total


def halved_crossentropy(y_true, y_pred):
    return 0.5 * keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True)


def pattern_custom_loss_and_metric():
    x, y = data()
    model = classifier()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=halved_crossentropy, metrics=[LabelSum()])
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y)


def pattern_sample_and_class_weight():
    x, y = data()
    weights = np.linspace(0.5, 1.5, len(x)).astype("float32")
    model = classifier()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), weighted_metrics=["accuracy"])
    first = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    second = model.fit(x, y, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return result(model, second, x, y, first=first.history)


def pattern_dict_inputs_two_outputs():
    x, y = data()
    seeded()
    numbers, extra = keras.Input((4,), name="numbers"), keras.Input((2,), name="extra")
    hidden = keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([numbers, extra]))
    model = keras.Model({"numbers": numbers, "extra": extra},
                        {"label": keras.layers.Dense(3, name="label")(hidden), "score": keras.layers.Dense(1, name="score")(hidden)})
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss={"label": loss(), "score": "mse"},
            loss_weights={"label": 1.0, "score": 0.5}, metrics={"label": ["accuracy"], "score": ["mae"]})
    inputs = {"numbers": x[:, :4], "extra": x[:, 4:]}
    targets = {"label": y, "score": x[:, :1] * 2}
    dataset = tf.data.Dataset.from_tensor_slices((inputs, targets)).batch(BATCH)
    history = model.fit(dataset, epochs=2, verbose=0)
    return {"weights": model.get_weights(), "history": history.history,
            "evaluate": model.evaluate(dataset, verbose=0, return_dict=True)}


def pattern_preprocessing_in_tf_data():
    """Text vectorized and numbers normalized inside the tf.data map, as the guides do."""
    rng = np.random.default_rng(3)
    words = np.array(["good", "bad", "fine", "poor", "great", "awful", "ok", "meh"])
    texts = np.array([" ".join(rng.choice(words, 5)) for _ in range(96)])
    labels = np.array([sum(t.count(w) for w in ("good", "fine", "great")) > 1 for t in texts]).astype("int32")
    numbers = rng.normal(3.0, 2.0, (96, 2)).astype("float32")
    vectorize = keras.layers.TextVectorization(max_tokens=20, output_mode="int", output_sequence_length=5)
    vectorize.adapt(texts)
    normalize = keras.layers.Normalization()
    normalize.adapt(numbers)
    dataset = (tf.data.Dataset.from_tensor_slices(((texts, numbers), labels)).batch(BATCH)
               .map(lambda inputs, label: ((vectorize(inputs[0]), normalize(inputs[1])), label))
               .prefetch(tf.data.AUTOTUNE))
    seeded()
    tokens, scaled = keras.Input((5,), dtype="int64"), keras.Input((2,))
    pooled = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(tokens))
    model = keras.Model([tokens, scaled], keras.layers.Dense(2)(keras.layers.Concatenate()([pooled, scaled])))
    compile(model, optimizer=keras.optimizers.SGD(0.2), loss=loss(), metrics=["accuracy"])
    history = model.fit(dataset, epochs=2, verbose=0)
    return {"weights": model.get_weights(), "history": history.history,
            "evaluate": model.evaluate(dataset, verbose=0, return_dict=True)}


class Batches(keras.utils.PyDataset):
    """A PyDataset that serves batches of arrays by index."""

    def __init__(self, x, y, batch_size, **kwargs):
        super().__init__(**kwargs)
        self.x, self.y, self.batch_size = x, y, batch_size

    def __len__(self):
        return -(-len(self.x) // self.batch_size)

    def __getitem__(self, index):
        part = slice(index * self.batch_size, (index + 1) * self.batch_size)
        return self.x[part], self.y[part]


def pattern_py_dataset():
    x, y = data()
    xv, yv = data(40, seed=1)
    model = classifier()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    history = model.fit(Batches(x, y, BATCH), validation_data=Batches(xv, yv, BATCH), epochs=2, shuffle=False, verbose=0)
    return {"weights": model.get_weights(), "history": history.history,
            "evaluate": model.evaluate(Batches(xv, yv, BATCH), verbose=0, return_dict=True),
            "predict": model.predict(Batches(xv, yv, BATCH), verbose=0)}


def pattern_validation_split():
    x, y = data(120)
    model = classifier()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, validation_split=0.2, shuffle=False, verbose=0))


def pattern_batchnorm_augmentation():
    """Random augmentation and batch statistics: not one process's result, but replicas agree."""
    rng = np.random.default_rng(4)
    images = rng.random((96, 8, 8, 1), dtype=np.float32)
    labels = (images.mean(axis=(1, 2, 3)) > 0.5).astype("int32")
    seeded()
    model = keras.Sequential([keras.Input((8, 8, 1)), keras.layers.RandomFlip("horizontal"),
                              keras.layers.Conv2D(4, 3), keras.layers.BatchNormalization(),
                              keras.layers.GlobalAveragePooling2D(), keras.layers.Dense(2)])
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    history = model.fit(images, labels, batch_size=BATCH, epochs=2, verbose=0)
    return {"weights": model.get_weights(), "history": history.history,
            "evaluate": model.evaluate(images, labels, batch_size=BATCH, verbose=0, return_dict=True)}


def pattern_callbacks():
    x, y = data()
    xv, yv = data(40, seed=1)
    model = classifier()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    files = os.path.join(OUT_DIR, f"callbacks-files-{MODE}")
    callbacks = [
        keras.callbacks.EarlyStopping(monitor="val_loss", patience=1, restore_best_weights=True),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=0, min_delta=1.0),
        keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.9),
        keras.callbacks.ModelCheckpoint(os.path.join(files, "best.keras"), monitor="val_loss", save_best_only=True),
        keras.callbacks.TensorBoard(os.path.join(files, "tensorboard")),
        keras.callbacks.CSVLogger(os.path.join(files, "log.csv")),
        keras.callbacks.BackupAndRestore(os.path.join(files, "backup")),
    ]
    history = model.fit(x, y, batch_size=BATCH, epochs=4, validation_data=(xv, yv), shuffle=False, verbose=0,
                        callbacks=callbacks)
    out = result(model, history, xv, yv, learning_rate=float(ops.convert_to_numpy(model.optimizer.learning_rate)))
    if CHIEF:
        with open(os.path.join(files, "log.csv")) as f:
            out["csv"] = list(csv.DictReader(f))
        out["best_predict"] = keras.models.load_model(os.path.join(files, "best.keras")).predict(xv, verbose=0)
        out["files"] = sorted(os.listdir(files))  # the chief's alone; the directory is shared
    return out


def pattern_evaluate_before_fit():
    """Evaluate and predict a model compiled without an optimizer, then train it and again."""
    x, y = data()
    model = classifier()
    compile(model, loss=loss(), metrics=["accuracy"])
    before = {"evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True),
              "predict": model.predict(x, batch_size=BATCH, verbose=0)}
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    return result(model, model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0), x, y, before=before)


def pattern_save_and_load():
    x, y = data()
    model = classifier()
    compile(model, optimizer=keras.optimizers.Adam(1e-2), loss=loss(), metrics=["accuracy"])
    history = model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    path = os.path.join(OUT_DIR, f"saved-{MODE}.keras")
    if CHIEF:
        model.save(path)
    if ctx is not None:
        ctx.collectives.barrier()
    loaded = keras.models.load_model(path)
    compile(loaded, optimizer=loaded.optimizer, loss=loss(), metrics=["accuracy"])  # resume training it
    more = loaded.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return result(loaded, more, x, y, first=history.history)


def pattern_mixed_precision():
    x, y = data()
    keras.mixed_precision.set_dtype_policy("mixed_float16")
    try:
        model = classifier()
        compile(model, optimizer=keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss=loss(),
                metrics=["accuracy"])
        return result(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y)
    finally:
        keras.mixed_precision.set_dtype_policy("float32")


class GAN(keras.Model):
    """The GAN of Keras's TensorFlow "customizing fit" guide: a `Model` subclass without
    `call()`, two sub-models, an optimizer each, random latent vectors in `train_step`."""

    def __init__(self, discriminator, generator, latent_dim):
        super().__init__()
        self.discriminator, self.generator, self.latent_dim = discriminator, generator, latent_dim
        self.seed_generator = keras.random.SeedGenerator(1337)
        self.d_loss_tracker = keras.metrics.Mean(name="d_loss")
        self.g_loss_tracker = keras.metrics.Mean(name="g_loss")

    @property
    def metrics(self):
        return [self.d_loss_tracker, self.g_loss_tracker]

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    def train_step(self, real):
        if isinstance(real, tuple):
            real = real[0]
        batch = tf.shape(real)[0]
        latent = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        combined = tf.concat([self.generator(latent), real], axis=0)
        labels = tf.concat([tf.ones((batch, 1)), tf.zeros((batch, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(combined))
        weights = self.discriminator.trainable_weights
        self.d_optimizer.apply(tape.gradient(d_loss, weights), weights)
        latent = keras.random.normal((batch, self.latent_dim), seed=self.seed_generator)
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(tf.zeros((batch, 1)), self.discriminator(self.generator(latent)))
        weights = self.generator.trainable_weights
        self.g_optimizer.apply(tape.gradient(g_loss, weights), weights)
        self.d_loss_tracker.update_state(d_loss)
        self.g_loss_tracker.update_state(g_loss)
        return {"d_loss": self.d_loss_tracker.result(), "g_loss": self.g_loss_tracker.result()}


def pattern_gan_without_call():
    x, _ = data()
    seeded()
    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)])
    gan = GAN(discriminator, generator, latent_dim=4)
    compile(gan, d_optimizer=keras.optimizers.Adam(1e-3), g_optimizer=keras.optimizers.Adam(1e-3),
            loss_fn=keras.losses.BinaryCrossentropy(from_logits=True))
    history = gan.fit(tf.data.Dataset.from_tensor_slices(x).batch(BATCH), epochs=2, verbose=0)
    return {"weights": [np.array(w) for w in discriminator.get_weights() + generator.get_weights()],
            "history": history.history}


class SqueezedLabelsLoss(keras.losses.Loss):
    """keras.io's supervised contrastive loss in small: it squeezes the labels and compares
    each with every other, so it needs their static rank, as any code reading a batch's shape."""

    def __init__(self, shapes, **kwargs):
        super().__init__(**kwargs)
        self.shapes = shapes

    def __call__(self, labels, outputs, sample_weight=None):
        self.shapes["loss"] = static_shape(labels)
        labels = tf.squeeze(labels)
        same = tf.cast(tf.equal(labels[:, None], labels[None, :]), "float32")  # needs a known rank
        logits = tf.matmul(outputs, outputs, transpose_b=True)
        return tf.reduce_mean(tf.nn.softmax_cross_entropy_with_logits(same / tf.reduce_sum(same, 1, keepdims=True),
                                                                      logits))


def shape_metric(shapes):
    def label_mean(y_true, y_pred):
        shapes["metric"] = static_shape(y_true)
        return ops.mean(ops.cast(y_true, "float32"), axis=-1)
    return keras.metrics.MeanMetricWrapper(label_mean, name="label_mean")


def static_shape(tensor):
    """A traced batch's shape as one plain process sees it, the batch's size as known or not."""
    dims = list(tensor.shape)
    return [dims[0] is not None, *dims[1:]]


def pattern_batch_shapes():
    """What train_step, the loss and the metrics see of a batch of arrays with (N, 1) labels:
    the static shapes one plain process sees (a contrastive loss compares pairs within a
    batch, so N replicas at B learn otherwise than one process at N*B: workers agree only)."""
    shapes = {}

    class Recording(keras.Sequential):
        def train_step(self, data):
            shapes["train_step"] = [static_shape(t) for t in tree.flatten(data)]
            return super().train_step(data)

    x, y = data()
    labels = y[:, None].astype("uint8")  # as keras.datasets.cifar10 gives them
    seeded()
    model = Recording([keras.Input((6,)), keras.layers.Dense(4, name="embedding")])
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=SqueezedLabelsLoss(shapes), metrics=[shape_metric(shapes)])
    history = model.fit(x, labels, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    return {"weights": model.get_weights(), "history": history.history, "shapes": shapes}


def pattern_zipped_timeseries():
    """keras.io's traffic forecasting in small: inputs and targets each from
    `timeseries_dataset_from_array` in batches, zipped, then prefetched and cached."""
    series = np.sin(np.arange(199, dtype="float32") / 7)[:, None] * np.ones((1, 3), "float32")
    inputs = keras.utils.timeseries_dataset_from_array(series[:-4], None, sequence_length=4, batch_size=BATCH)
    targets = keras.utils.timeseries_dataset_from_array(series[4:, :1], None, sequence_length=1, batch_size=BATCH)
    zipped = tf.data.Dataset.zip((inputs, targets)).prefetch(16).cache()
    seeded()
    model = keras.Sequential([keras.Input((4, 3)), keras.layers.Flatten(), keras.layers.Dense(1)])
    compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(zipped, epochs=2, verbose=0)
    return {"weights": model.get_weights(), "history": history.history,
            "evaluate": model.evaluate(zipped, verbose=0, return_dict=True)}


def pattern_alternating_labels():
    return alternating_labels(compile, BATCH, ["arrays", "tf_data"])


def pattern_checkpoint_reload_and_callback_files():
    return checkpoint_reload_and_callback_files(compile, BATCH, OUT_DIR, RANK)


if __name__ == "__main__":
    run_patterns(globals(), NAMES, OUT_DIR, RANK)
