"""Every structure of arrays `fit` takes, fed as a script feeds it, in one process launch.

    python array_structures.py OUT_DIR plain|keras_dist CELL [CELL ...]

Each cell is one `fit` of arrays: x one array, a list, a tuple or a dict; y absent (a
custom `train_step` that reads `data` as keras.io's VAE does), one array, a list or a dict;
sample_weight; class_weight; validation_split; shuffle True, False or "batch"; float64
inputs, which Keras's array adapter casts to floatx. Where several processes read, a
shuffled `fit` goes through keras_dist's ordered path (`keras_dist.inputs.arrays.EpochRows`),
an unshuffled one through the split: either way `train_step` must get what Keras's own
array adapter gives one plain process (`seen`: the nesting and each leaf's dtype and rank,
recorded as the step is traced), and end where one plain process at the global batch
does. Each epoch is one global batch, so the order a shuffle draws changes nothing.

Each cell's result is pickled to OUT_DIR/CELL.RANK.pkl (`pattern_runner.run_patterns`).
"""

import sys

import keras
import numpy as np
from keras import ops

import keras_dist
from pattern_runner import compile_for, run_patterns

OUT_DIR, MODE, NAMES = sys.argv[1], sys.argv[2], sys.argv[3:]
TRAIN = 32  # samples trained per epoch: the global batch, one step per epoch
ctx = keras_dist.init() if MODE == "keras_dist" else None
RANK = ctx.rank if ctx else 0
BATCH = TRAIN // (ctx.num_replicas if ctx else 1)
compile = compile_for(MODE)
SEEN = {}  # cell: what train_step got, as it was traced


def describe(data):
    """The nesting of `data` and each leaf's dtype and rank, as a plain structure."""
    if isinstance(data, dict):
        return {"dict": {key: describe(value) for key, value in sorted(data.items())}}
    if isinstance(data, (list, tuple)):
        return [type(data).__name__, *(describe(part) for part in data)]
    if data is None:
        return "None"
    return f"{keras.backend.standardize_dtype(data.dtype)} rank {len(data.shape)}"


class Recording(keras.Model):
    """Keras's own train_step, after noting what it got (on JAX, after the state)."""

    cell = None

    def train_step(self, *state_and_data):
        SEEN[self.cell] = describe(state_and_data[-1])
        return super().train_step(*state_and_data)


class Reconstructing(Recording):
    """`fit(x)` without targets on JAX and PyTorch, where a step of one's own is the
    backend's own code: Keras's step, with the loss taken against the inputs."""

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        target = x[1] if isinstance(x, (list, tuple)) else x  # a pair: the second reconstructed
        return ops.mean(keras.losses.mean_squared_error(target, y_pred))


class Autoencoder(keras.Model):
    """keras.io's VAE's way with `fit(x)` on TensorFlow: `train_step` takes `data` itself as
    the batch."""

    cell = None

    def __init__(self):
        super().__init__()
        self.code = keras.layers.Dense(2, activation="tanh")
        self.back = keras.layers.Dense(6)
        self.loss_tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.back(self.code(x))

    @property
    def metrics(self):
        return [self.loss_tracker]

    def train_step(self, data):
        import tensorflow as tf

        SEEN[self.cell] = describe(data)
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.mean_squared_error(data, self(data, training=True)))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


class PairAutoencoder(Autoencoder):
    """`fit([a, b])` without targets: `train_step` unpacks the one-element tuple Keras gives."""

    def call(self, pair):
        return super().call(pair[0])

    def train_step(self, data):
        import tensorflow as tf

        SEEN[self.cell] = describe(data)
        (a, b), = data
        with tf.GradientTape() as tape:
            loss = ops.mean(keras.losses.mean_squared_error(b, self((a, b), training=True)))
        self.optimizer.apply(tape.gradient(loss, self.trainable_weights), self.trainable_weights)
        self.loss_tracker.update_state(loss)
        return {"loss": self.loss_tracker.result()}


def features(count, dtype="float64"):
    """`count` samples of 6 features (float64, as NumPy makes them) and labels of 3 classes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(count, 6)).astype(dtype)
    y = np.argmax(x[:, :3] + 0.5 * x[:, 3:], axis=1).astype("int32")
    return x, y


def two_inputs(kind):
    """A model of two inputs (4 and 2 features) given as a list, tuple or dict, and 3 logits."""
    keras.utils.set_random_seed(7)
    numbers, extra = keras.Input((4,), name="numbers"), keras.Input((2,), name="extra")
    logits = keras.layers.Dense(3)(keras.layers.Dense(8, activation="tanh")(keras.layers.Concatenate()([numbers, extra])))
    inputs = {"list": [numbers, extra], "tuple": (numbers, extra), "dict": {"numbers": numbers, "extra": extra}}[kind]
    return Recording(inputs, logits)


def split_features(x, kind):
    return {"list": [x[:, :4], x[:, 4:]], "tuple": (x[:, :4], x[:, 4:]), "dict": {"numbers": x[:, :4], "extra": x[:, 4:]}}[kind]


def one_input(outputs=None):
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    if outputs is None:
        return Recording(inputs, keras.layers.Dense(3)(hidden))
    heads = [keras.layers.Dense(3, name="label")(hidden), keras.layers.Dense(1, name="score")(hidden)]
    return Recording(inputs, heads if outputs == "list" else {"label": heads[0], "score": heads[1]})


def sparse():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def trained(cell, model, fit_args, compile_args, **fit_kwargs):
    model.cell = cell
    compile(model, optimizer=keras.optimizers.SGD(0.1), **compile_args)
    history = model.fit(*fit_args, batch_size=BATCH, epochs=2, verbose=0, **fit_kwargs)
    return {"weights": [np.array(w) for w in model.get_weights()], "history": history.history, "seen": SEEN.get(cell)}


def inputs_cell(kind, shuffle, **fit_kwargs):
    def cell():
        name = f"{kind}_x_shuffle_{shuffle}"
        x, y = features(TRAIN + 8 if fit_kwargs.get("validation_split") else TRAIN)
        return trained(name, two_inputs(kind), (split_features(x, kind), y), {"loss": sparse()}, shuffle=shuffle,
                       **fit_kwargs)
    return cell


def outputs_cell(kind, shuffle, weights):
    def cell():
        x, y = features(TRAIN)
        targets = [y, x[:, :1]] if kind == "list" else {"label": y, "score": x[:, :1]}
        losses = [sparse(), "mse"] if kind == "list" else {"label": sparse(), "score": "mse"}
        sample_weight = np.linspace(0.5, 1.5, TRAIN) if weights else None  # one array for every output
        return trained(f"{kind}_y", one_input(kind), (x, targets), {"loss": losses}, sample_weight=sample_weight,
                       shuffle=shuffle)
    return cell


def autoencoder(pair=False):
    keras.utils.set_random_seed(7)
    if keras.backend.backend() == "tensorflow":
        return PairAutoencoder() if pair else Autoencoder()
    inputs = [keras.Input((6,)), keras.Input((6,))] if pair else keras.Input((6,))
    code = keras.layers.Dense(2, activation="tanh")(inputs[0] if pair else inputs)
    return Reconstructing(inputs, keras.layers.Dense(6)(code))


def pattern_autoencoder_shuffle_True():
    x, _ = features(TRAIN)
    return trained("autoencoder_shuffle_True", autoencoder(), (x,), {}, shuffle=True)


def pattern_autoencoder_shuffle_False():
    x, _ = features(TRAIN)
    return trained("autoencoder_shuffle_False", autoencoder(), (x,), {}, shuffle=False)


def pattern_pair_autoencoder():
    x, _ = features(TRAIN)
    return trained("pair_autoencoder", autoencoder(pair=True), ([x, x],), {}, shuffle=True)


def pattern_sample_weight():
    x, y = features(TRAIN)
    return trained("sample_weight", one_input(), (x, y), {"loss": sparse(), "weighted_metrics": ["accuracy"]},
                   sample_weight=np.linspace(0.5, 1.5, TRAIN), shuffle=True)


def pattern_class_weight():
    x, y = features(TRAIN + 8)
    return trained("class_weight", one_input(), (x, y), {"loss": sparse(), "weighted_metrics": ["accuracy"]},
                   class_weight={0: 1.0, 1: 2.0, 2: 0.5}, validation_split=0.2, shuffle="batch")


pattern_list_x = inputs_cell("list", True, validation_split=0.2)
pattern_list_x_unshuffled = inputs_cell("list", False, validation_split=0.2)
pattern_tuple_x = inputs_cell("tuple", "batch")
pattern_dict_x = inputs_cell("dict", True, validation_split=0.2)
pattern_list_y = outputs_cell("list", True, weights=True)
pattern_dict_y = outputs_cell("dict", "batch", weights=False)



def reported(cell):
    """`cell`, its error kept as its result: one cell's failure must not hide the others'
    (each fails on every rank alike, before its first collective)."""
    def run():
        try:
            return cell()
        except Exception as exc:  # noqa: BLE001
            return {"error": f"{type(exc).__name__}: {str(exc)[:1000]}"}
    return run


if __name__ == "__main__":
    run_patterns({name: reported(cell) for name, cell in globals().items() if name.startswith("pattern_")},
                 NAMES, OUT_DIR, RANK)
