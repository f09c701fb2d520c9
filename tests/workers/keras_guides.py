"""What Keras's guides for JAX and PyTorch do, written here as small scripts of our own.

    python keras_guides.py OUT_DIR plain|keras_dist PATTERN [PATTERN ...]

Written after reading Keras's guides "Customizing what happens in fit()" (its JAX,
PyTorch and TensorFlow versions), "The Sequential model", "Training & evaluation with
the built-in methods" (metric objects, DataLoader input) and the transfer-learning
guide. The same script runs as one plain process (`plain`: `model.compile`) and with
the two-line change (`keras_dist`: `keras_dist.compile`) under any launcher, on the
Keras backend KERAS_BACKEND names. The global batch is fixed (GLOBAL_BATCH); the batch
a pattern passes is GLOBAL_BATCH / replicas.

Patterns named `seeded_*` seed the script (the same seed everywhere) and must end
where one plain process does; `unseeded_*` leave the seed to keras_dist (every rank
must agree, and a frozen layer must not move). Each result is pickled to
OUT_DIR/PATTERN.RANK.pkl; a refused pattern stores {"refused": message}.
"""

import os
import sys

import keras
import numpy as np
from keras import ops

import keras_dist  # noqa: F401  (its start-up effects, as in a script)
from keras_dist import environments
from pattern_runner import alternating_labels, checkpoint_reload_and_callback_files, compile_for, data_of, run_patterns

OUT_DIR, MODE, NAMES = sys.argv[1], sys.argv[2], sys.argv[3:]
GLOBAL_BATCH = 16
# Read from the launcher's variables, not `keras_dist.init()`: a guide's script calls
# nothing of keras_dist's before its first compile (one replica per process here).
JOB = environments.detect(os.environ) if MODE == "keras_dist" else None
RANK = JOB.rank if JOB else 0
BATCH = GLOBAL_BATCH // (JOB.size if JOB else 1)
BACKEND = keras.backend.backend()


compile = compile_for(MODE)  # the one line the two-line change touches


# 70 samples leave an uneven last batch at every batch size used.
data = data_of(70)


def mlp():
    """An unbuilt Sequential, as the Sequential guide writes it: `fit` builds it."""
    return keras.Sequential([keras.layers.Dense(8, activation="relu", name="hidden"), keras.layers.Dense(3, name="logits")])


def loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def summary(model, history, x=None, y=None, **extra):
    out = {"weights": [np.array(w) for w in model.get_weights()], "history": history.history, **extra}
    if x is not None:
        out["evaluate"] = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
        out["predict"] = model.predict(x, batch_size=BATCH, verbose=0)
    return out


class LabelSum(keras.metrics.Metric):
    """A metric with state of its own, as the training guide's custom metric."""

    def __init__(self, name="label_sum", **kwargs):
        super().__init__(name=name, **kwargs)
        self.total = self.add_variable((), initializer="zeros", name="total")

    def update_state(self, y_true, y_pred, sample_weight=None):
        self.total.assign_add(ops.sum(ops.cast(y_true, "float32")))

    def result(self):
        return ops.convert_to_tensor(self.total)


# --- the custom train_step of each backend's "customizing fit" guide -------------------
class GuideStep(keras.Model):
    """Its own loss and metric trackers, made in `__init__` and listed in `metrics`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.loss_tracker = keras.metrics.Mean(name="loss")
        self.accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

    @property
    def metrics(self):
        return [self.loss_tracker, self.accuracy]

    if BACKEND == "jax":
        def compute_loss_and_updates(self, trainable, non_trainable, x, y):
            y_pred, non_trainable = self.stateless_call(trainable, non_trainable, x, training=True)
            return self.compute_loss(x, y, y_pred), (y_pred, non_trainable)

        def train_step(self, state, data):
            import jax

            trainable, non_trainable, optimizer_variables, metric_variables = state
            x, y = data
            (value, (y_pred, non_trainable)), grads = jax.value_and_grad(self.compute_loss_and_updates, has_aux=True)(
                trainable, non_trainable, x, y)
            trainable, optimizer_variables = self.optimizer.stateless_apply(optimizer_variables, grads, trainable)
            loss_state = self.loss_tracker.stateless_update_state(metric_variables[:len(self.loss_tracker.variables)], value)
            accuracy_state = self.accuracy.stateless_update_state(metric_variables[len(loss_state):], y, y_pred)
            logs = {"loss": self.loss_tracker.stateless_result(loss_state),
                    "accuracy": self.accuracy.stateless_result(accuracy_state)}
            return logs, (trainable, non_trainable, optimizer_variables, loss_state + accuracy_state)
    elif BACKEND == "torch":
        def train_step(self, data):
            import torch

            x, y = data
            self.zero_grad()
            y_pred = self(x, training=True)
            value = self.compute_loss(y=y, y_pred=y_pred)
            value.backward()
            with torch.no_grad():
                self.optimizer.apply([v.value.grad for v in self.trainable_weights], self.trainable_weights)
            self.loss_tracker.update_state(value)
            self.accuracy.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}
    else:
        def train_step(self, data):
            import tensorflow as tf

            x, y = data
            with tf.GradientTape() as tape:
                y_pred = self(x, training=True)
                value = self.compute_loss(y=y, y_pred=y_pred)
            self.optimizer.apply(tape.gradient(value, self.trainable_variables), self.trainable_variables)
            self.loss_tracker.update_state(value)
            self.accuracy.update_state(y, y_pred)
            return {m.name: m.result() for m in self.metrics}


def pattern_seeded_custom_train_step():
    x, y = data()
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    model = GuideStep(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(inputs)))
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss())
    return summary(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0))


def pattern_seeded_metric_objects():
    """Metric objects made by the script (not names), one with state of its own."""
    x, y = data()
    keras.utils.set_random_seed(7)
    model = mlp()
    compile(model, optimizer=keras.optimizers.Adam(1e-2), loss=loss(),
            metrics=[keras.metrics.SparseCategoricalAccuracy(), LabelSum()])
    return summary(model, model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y)


def pattern_seeded_sum_metrics():
    """Metrics whose states are sums over samples (confusion-matrix counts, weighted totals),
    with sample weights in `fit` and `evaluate`: each replica's counts must enter the logs
    once: a ratio hides counts summed twice, the count of true positives does not. Keras 3.16
    all-reduces metric variables itself on PyTorch (keras#23316)."""
    x, y = data()
    positive = (y == 0).astype("float32")
    weights = np.linspace(0.25, 2.0, len(y)).astype("float32")
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1, activation="sigmoid")])
    compile(model, optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy",
            metrics=[keras.metrics.AUC(name="auc"), keras.metrics.Precision(name="precision"),
                     keras.metrics.Recall(name="recall"), keras.metrics.TruePositives(name="true_positives")],
            weighted_metrics=[keras.metrics.MeanSquaredError(name="weighted_mse")])
    # No validation inside fit: on PyTorch, Keras 3.15's logs hold TruePositives' result as a
    # view of its state until validation has overwritten it (one plain process logs the
    # validation count as the training one); `evaluate` covers the same metrics.
    history = model.fit(x, positive, sample_weight=weights, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
    return summary(model, history, x, positive,
                   weighted_evaluate=model.evaluate(x, positive, sample_weight=weights, batch_size=BATCH,
                                                    verbose=0, return_dict=True))


def pattern_seeded_second_model():
    """A second model, built and compiled after the first one trained."""
    x, y = data()
    keras.utils.set_random_seed(7)
    first = mlp()
    compile(first, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    first.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    second = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)])
    compile(second, optimizer=keras.optimizers.Adam(1e-2), loss=loss(), metrics=["accuracy"])
    return summary(second, second.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0), x, y,
                   first=[np.array(w) for w in first.get_weights()])


def pattern_seeded_evaluate_unfitted():
    """`evaluate` and `predict` on a model that never trained, then training it."""
    x, y = data()
    keras.utils.set_random_seed(7)
    model = mlp()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    before = {"evaluate": model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True),
              "predict": model.predict(x, batch_size=BATCH, verbose=0)}
    return summary(model, model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0), x, y, before=before)


def pattern_seeded_structured_inputs():
    """A two-input model fed a list of arrays, then a dict, with `validation_split` (keras.io's
    multi-input examples); then `evaluate` and `predict` on fewer samples than processes, as a
    script's last one-sample prediction."""
    x, y = data(40)  # 32 to train, 8 held out: every process's share is whole batches
    keras.utils.set_random_seed(7)
    numbers, extra = keras.Input((4,), name="numbers"), keras.Input((2,), name="extra")
    logits = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([numbers, extra])))
    as_list, as_dict = [x[:, :4], x[:, 4:]], {"numbers": x[:, :4], "extra": x[:, 4:]}
    by_list, by_dict = keras.Model([numbers, extra], logits), keras.Model({"numbers": numbers, "extra": extra}, logits)
    for model in (by_list, by_dict):  # one set of layers, two ways in
        compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    first = by_list.fit(as_list, y, batch_size=BATCH, epochs=2, validation_split=0.2, shuffle=False, verbose=0)
    second = by_dict.fit(as_dict, y, batch_size=BATCH, epochs=1, validation_split=0.2, shuffle=False, verbose=0)
    one = {k: v[:1] for k, v in as_dict.items()}
    return {"weights": [np.array(w) for w in by_dict.get_weights()], "history": first.history,
            "second": second.history, "evaluate_one": by_dict.evaluate(one, y[:1], verbose=0, return_dict=True),
            "predict_one": by_dict.predict(one, verbose=0),
            "predict_three": by_list.predict([a[:3] for a in as_list], batch_size=BATCH, verbose=0)}


def batches(x, y=None, batch_size=None):
    """A Python generator of consecutive batches, as scripts write them for `fit`."""
    batch_size = batch_size or BATCH
    for start in range(0, len(x), batch_size):
        yield (x[start:start + batch_size],) if y is None else (x[start:start + batch_size], y[start:start + batch_size])


def pattern_seeded_generator():
    """`fit`, `evaluate` and `predict` fed Python generators: training and validation of whole
    global batches, one batch to evaluate (fewer than processes), and a prediction in
    batches of 5 whose last is short."""
    x, y = data(48)
    keras.utils.set_random_seed(7)
    model = mlp()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    history = model.fit(batches(x[:32], y[:32]), validation_data=batches(x[32:], y[32:]), epochs=1, verbose=0)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history,
            "evaluate_one": model.evaluate(batches(x[:5], y[:5]), verbose=0, return_dict=True),
            "predict": model.predict(batches(x[:23], batch_size=5), verbose=0)}


class Rows(keras.utils.PyDataset):
    """A PyDataset serving consecutive batches of arrays by index."""

    def __init__(self, *arrays, batch_size):
        super().__init__()
        self.arrays, self.batch_size = arrays, batch_size

    def __len__(self):
        return -(-len(self.arrays[0]) // self.batch_size)

    def __getitem__(self, index):
        return tuple(a[index * self.batch_size:(index + 1) * self.batch_size] for a in self.arrays)


def few_samples_input(kind, x, y=None):
    """`x` (and `y`) as input of `kind`, in batches of 4."""
    arrays = (x,) if y is None else (x, y)
    if kind == "arrays":
        return arrays
    if kind == "py_dataset":
        return (Rows(*arrays, batch_size=4),)
    if kind == "generator":
        return (batches(*arrays, batch_size=4),)
    if kind == "tf_data":
        import tensorflow as tf

        return (tf.data.Dataset.from_tensor_slices(arrays).batch(4),)
    import torch

    return (torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*map(torch.from_numpy, arrays)), batch_size=4),)


def pattern_seeded_fewer_samples_than_processes():
    """`evaluate` and `predict` on 1 and 3 samples (fewer than processes, and not a multiple of
    them) given as arrays, a PyDataset, a generator, a tf.data.Dataset and a DataLoader."""
    x, y = data(5)
    keras.utils.set_random_seed(7)
    model = keras.Sequential([keras.Input((6,)), keras.layers.BatchNormalization(), keras.layers.Dense(3)])
    compile(model, optimizer="sgd", loss=loss(), metrics=["accuracy"])
    kinds = ["arrays", "py_dataset", "generator", "tf_data", "torch"]
    if BACKEND == "tensorflow" and "TF_CONFIG" in os.environ:  # MultiWorkerMirrored: collective steps
        kinds = ["arrays", "py_dataset", "tf_data"]
    out = {}
    for kind in kinds:
        for count in (1, 3):
            out[f"{kind}_evaluate_{count}"] = model.evaluate(*few_samples_input(kind, x[:count], y[:count]), verbose=0)
            out[f"{kind}_predict_{count}"] = model.predict(*few_samples_input(kind, x[:count]), verbose=0)
    return out


def loaders(x, y, shuffle, batch_size=None):
    """Torch DataLoaders of the arrays, as the training guide builds them (a TensorDataset)."""
    import torch

    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    return (torch.utils.data.DataLoader(dataset, batch_size=batch_size or BATCH, shuffle=shuffle),
            torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.from_numpy(x[:23]), torch.from_numpy(y[:23])),
                                        batch_size=batch_size or BATCH))


def pattern_seeded_dataloader():
    """DataLoaders for fit and validation (uneven last batches), then evaluate and predict on one."""
    x, y = data()
    keras.utils.set_random_seed(7)
    train, validation = loaders(x, y, shuffle=False)
    model = mlp()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    history = model.fit(train, validation_data=validation, epochs=2, verbose=0)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history,
            "evaluate": model.evaluate(validation, verbose=0, return_dict=True),
            "predict": model.predict(validation, verbose=0)}


def pattern_unseeded_dataloader_shuffled():
    """A shuffling DataLoader with its own collate_fn: every replica must take its share of
    one permutation per epoch (the collate_fn records which samples this replica read)."""
    import torch

    x, y = data()
    seen = []

    def collate(samples):
        batch = torch.utils.data.default_collate(samples)
        seen.extend(batch[0][:, 0].tolist())
        return batch

    dataset = torch.utils.data.TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    train = torch.utils.data.DataLoader(dataset, batch_size=BATCH, shuffle=True, collate_fn=collate)
    model = mlp()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss(), metrics=["accuracy"])
    ends = keras.callbacks.LambdaCallback(on_epoch_end=lambda epoch, logs: marks.append(len(seen)))
    marks = []
    history = model.fit(train, epochs=2, verbose=0, callbacks=[ends])
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history,
            "seen": [seen[:marks[0]], seen[marks[0]:marks[1]]]}


def pattern_unseeded_iterable_dataset():
    """An IterableDataset, which has no index to split by."""
    import torch

    x, y = data()

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(zip(torch.from_numpy(x), torch.from_numpy(y)))

    model = mlp()
    compile(model, optimizer=keras.optimizers.SGD(0.1), loss=loss())
    history = model.fit(torch.utils.data.DataLoader(Stream(), batch_size=BATCH), epochs=1, verbose=0)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history}


def pattern_unseeded_transfer_learning():
    """The transfer-learning guide: an unseeded base, frozen; its weights must not move in fit,
    and a model made after the first compile (the new head) must start the same everywhere."""
    x, y = data()
    base = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu")])
    base.trainable = False
    frozen = [np.array(w) for w in base.get_weights()]
    first = keras.Sequential([base, keras.layers.Dense(3)])
    compile(first, optimizer=keras.optimizers.Adam(1e-2), loss=loss(), metrics=[keras.metrics.SparseCategoricalAccuracy()])
    first.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    moved = [not np.array_equal(a, np.array(b)) for a, b in zip(frozen, base.get_weights())]
    head = mlp()  # unbuilt, made after the first compile: fit builds it
    compile(head, optimizer=keras.optimizers.SGD(0.1), loss=loss())
    history = head.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return {"frozen_moved": any(moved), "weights": [np.array(w) for w in first.get_weights() + head.get_weights()],
            "history": history.history}


def pattern_alternating_labels():
    return alternating_labels(compile, BATCH, ["arrays", "tf_data", "dataloader"])


def pattern_checkpoint_reload_and_callback_files():
    return checkpoint_reload_and_callback_files(compile, BATCH, OUT_DIR, RANK)


if __name__ == "__main__":
    run_patterns(globals(), NAMES, OUT_DIR, RANK)
