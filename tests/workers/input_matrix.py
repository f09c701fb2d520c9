"""The input matrix, in one process on the Keras backend of KERAS_BACKEND: every structure x
size x process count x purpose, each rank's split made by `keras_dist.inputs` as that rank
would make it (a simulated rank: the real input plan, and no collectives to call).

Each sample's features hold its id, so the checks are exact: training shards are equally
long and cover every training sample, evaluation shards count each sample once, predict
shards put back in interleaved order give the input's rows in order, and every leaf keeps
its type; Python generators of batches are split and checked the same way. For one size
per structure, Keras itself then runs `fit`, `evaluate` and
`predict` on every rank's share, and `fit` on every rank's share in the order keras_dist
draws (a shuffled `fit` of several processes, `keras_dist.inputs.arrays.EpochRows`), whose
steps must get what Keras's own array adapter gives one process: the same nesting, leaf
types and dtypes (float64 arrays cast to floatx). Prints one JSON line: {"cases": n,
"failures": [...]}.
"""

import json
import os
import sys

import keras
import numpy as np
import pandas
import scipy.sparse
from keras import tree

from keras_dist import inputs
from keras_dist.errors import KerasDistError
from keras_dist.inputs.generators import reassemble
from keras_dist.collectives import Collectives
from keras_dist.inputs.position import EpochPosition
from keras_dist.replicas import Replicas

BACKEND = keras.backend.backend()
SIZES = (0, 1, 2, 3, 4, 7)
PROCESSES = (1, 2, 3)
PURPOSES = ("fit_validation_split", "fit_validation_data", "evaluate", "predict")


class SimulatedRank(Replicas):
    """Rank `index` of a job of `num_shards` processes, as `keras_dist.inputs` sees it, with
    no collective: a split that needed one fails the case."""

    name = "simulated"

    def __init__(self, num_shards, index):
        self._size, self._rank = num_shards, index

    @property
    def rank(self):
        return self._rank

    @property
    def size(self):
        return self._size

    @property
    def collectives(self):
        return NoCollectives()


class NoCollectives(Collectives):
    """Collectives that fail the case: the simulated ranks run alone."""

    def allgather_object(self, *args, **kwargs):
        raise AssertionError("arrays are split without collectives")

    broadcast_object = broadcast_variables = allgather_array = sum_arrays = barrier = allgather_object


def ids(n, width=2):
    return np.repeat(np.arange(n, dtype="float32")[:, None], width, axis=1)


def as_leaf(kind, column):
    """`column` (n x 2 float ids) as a leaf of `kind`."""
    if kind == "numpy":
        return column
    if kind == "pandas":
        return pandas.DataFrame(column, columns=["a", "b"])
    if kind == "series":
        return pandas.Series(column[:, 0])
    if kind == "scipy_sparse":
        return scipy.sparse.csr_matrix(column)
    if kind == "tf":
        import tensorflow as tf

        return tf.constant(column)
    if kind == "tf_sparse":
        import tensorflow as tf

        return tf.sparse.from_dense(column)
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(column)
    if kind == "torch":
        import torch

        return torch.as_tensor(column)
    raise ValueError(kind)


# name: (x of n samples, y of n samples, sample_weight of n samples or None)
STRUCTURES = {
    "array": lambda n: (ids(n), ids(n, 1), None),
    "list": lambda n: ([ids(n), ids(n, 3)], ids(n, 1), None),
    "tuple": lambda n: ((ids(n), ids(n, 3)), ids(n, 1), None),
    "dict": lambda n: ({"a": ids(n), "b": ids(n, 3)}, ids(n, 1), None),
    "nested": lambda n: ({"a": [ids(n), ids(n, 1)], "b": {"c": ids(n, 3)}}, ids(n, 1), None),
    "dict_y_and_weights": lambda n: ({"a": ids(n)}, {"out1": ids(n, 1), "out2": ids(n, 1)},
                                     {"out1": np.ones(n, "float32"), "out2": np.ones(n, "float32")}),
    "sample_weight": lambda n: (ids(n), ids(n, 1), np.arange(n, dtype="float32") + 1),
    "list_y_one_weight": lambda n: (ids(n), [ids(n, 1), ids(n, 2)], np.arange(n, dtype="float32") + 1),
    "float64": lambda n: ((ids(n).astype("float64"), ids(n, 3).astype("float64")), ids(n, 1).astype("float64"),
                          np.ones(n)),
    "no_y": lambda n: (ids(n).astype("float64"), None, None),
    "no_y_list": lambda n: ([ids(n), ids(n, 3)], None, None),
    "no_y_dict": lambda n: ({"a": ids(n), "b": ids(n, 3)}, None, None),
    "pandas": lambda n: (as_leaf("pandas", ids(n)), as_leaf("series", ids(n)), None),
    "scipy_sparse": lambda n: (as_leaf("scipy_sparse", ids(n)), ids(n, 1), None),
    f"{BACKEND}_tensors": lambda n: ([as_leaf({"tensorflow": "tf"}.get(BACKEND, BACKEND), ids(n))] * 2, ids(n, 1), None),
}
if BACKEND == "torch":  # Keras reads scipy sparse matrices on TensorFlow and JAX only
    del STRUCTURES["scipy_sparse"]
if BACKEND == "tensorflow":
    STRUCTURES["tf_sparse"] = lambda n: ({"a": as_leaf("tf_sparse", ids(n)), "b": ids(n)}, ids(n, 1), None)


def row_ids(data):
    """The sample id of each row of a structure (its first leaf's first column)."""
    leaf = next(a for a in tree.flatten(data) if a is not None)
    if scipy.sparse.issparse(leaf):
        leaf = leaf.toarray()
    elif type(leaf).__name__ == "SparseTensor":
        import tensorflow as tf

        leaf = tf.sparse.to_dense(leaf)
    values = np.asarray(leaf.to_numpy() if hasattr(leaf, "to_numpy") else keras.ops.convert_to_numpy(leaf))
    return [int(v) for v in values.reshape(len(values), -1)[:, 0]] if len(values) else []


def leaf_types(data):
    return [type(a).__name__ for a in tree.flatten(data)]


def split(purpose, structure, length, num_shards):
    """[(rank's Inputs for the call, rank's validation Inputs or None)] for every rank."""
    x, y, weights = STRUCTURES[structure](length)
    out = []
    for rank in range(num_shards):
        strategy = SimulatedRank(num_shards, rank)
        data = inputs.Inputs(x, y, weights, batch_size=2)
        if purpose == "fit_validation_split":
            out.append(inputs.fit(strategy, data, validation_split=0.5))
        elif purpose == "fit_validation_data":
            out.append(inputs.fit(strategy, data, validation_data=(x, y, weights)))
        else:
            out.append((getattr(inputs, purpose)(strategy, data), None))
    return (x, y, weights), out


def check(purpose, structure, length, num_shards):
    """The failures of one case, as strings."""
    try:
        (x, y, weights), ranks = split(purpose, structure, length, num_shards)
    except KerasDistError as exc:
        one_line = "\n" not in str(exc)
        return [] if length == 0 and num_shards > 1 and one_line else [f"KerasDistError: {exc}"]
    except ValueError as exc:  # Keras's own refusal: validation_split of too few samples, as without keras_dist
        refused = purpose == "fit_validation_split" and length < 2 and "not sufficient" in str(exc)
        return [] if refused else [f"{type(exc).__name__}: {exc}"]
    if length == 0 and num_shards > 1:
        return ["no error for an empty input"]
    failures = []
    expected_types = leaf_types(x) + leaf_types(y) + leaf_types(weights)

    def same_kind(data, where):
        got = leaf_types(data.x) + leaf_types(data.y) + leaf_types(data.sample_weight)
        # Keras's slicing casts float64 leaves to floatx and reads JAX arrays as NumPy, as its adapter does.
        if [t.replace("ArrayImpl", "ndarray") for t in got] != [t.replace("ArrayImpl", "ndarray") for t in expected_types]:
            failures.append(f"{where}: leaf types {got} != {expected_types}")
        lengths = {len(row_ids(part)) for part in (data.x, data.y, data.sample_weight) if part is not None}
        if len(lengths) > 1:
            failures.append(f"{where}: x, y, sample_weight lengths differ {lengths}")

    if purpose.startswith("fit"):
        train_length = length // 2 if purpose == "fit_validation_split" else length
        shards = [data for data, _ in ranks]
        for rank, data in enumerate(shards):
            same_kind(data, f"rank {rank} train")
        if len({len(row_ids(d.x)) for d in shards}) != 1:
            failures.append(f"train shards differ in length: {[len(row_ids(d.x)) for d in shards]}")
        if sorted(set(sum((row_ids(d.x) for d in shards), []))) != list(range(train_length)):
            failures.append("train shards do not cover every training sample")
        held = [v for _, v in ranks]
        first = train_length if purpose == "fit_validation_split" else 0
        counted = sum((row_ids(v.x) for v in held if not v.stand_in), [])
        if sorted(counted) != list(range(first, length)):
            failures.append(f"validation counts {sorted(counted)}, not each of {first}..{length - 1} once")
    elif purpose == "evaluate":
        shards = [data for data, _ in ranks]
        for rank, data in enumerate(shards):
            same_kind(data, f"rank {rank}")
            if len(row_ids(data.x)) == 0 and num_shards > 1:
                failures.append(f"rank {rank}: an empty share reaches Keras")
        counted = sum((row_ids(d.x) for d in shards if not d.stand_in), [])
        if sorted(counted) != list(range(length)):
            failures.append(f"evaluate counts {sorted(counted)}, not each sample once")
    else:
        shards = [data for data, _ in ranks]
        for rank, data in enumerate(shards):
            if len(row_ids(data.x)) == 0 and length:
                failures.append(f"rank {rank}: an empty share reaches Keras")
        parts = [row_ids(d.x) for d in shards]
        if len({len(p) for p in parts}) != 1 and num_shards > 1:
            failures.append(f"predict shards differ in length: {[len(p) for p in parts]}")
        order = [None] * sum(len(p) for p in parts)
        for rank, part in enumerate(parts):
            order[rank::num_shards] = part
        samples = shards[0].samples if num_shards > 1 else length
        if order[:samples] != list(range(length)):
            failures.append(f"predict gathers rows {order[:samples]}, not 0..{length - 1}")
    return failures


def batches_of(count):
    """A generator of `count` (x, y) batches of 1 to 3 rows, the rows numbered in order."""
    start = 0
    for i in range(count):
        rows = ids(start + i % 3 + 1)[start:]
        yield rows, rows[:, :1]
        start += len(rows)


def check_generator(purpose, count, num_shards):
    """The failures of one generator case: each rank's batches, as Keras would read them."""
    total = sum(i % 3 + 1 for i in range(count))
    ranks = []
    for rank in range(num_shards):
        data = inputs.Inputs(batches_of(count))
        if purpose == "fit_validation_data":
            data, _ = inputs.fit(SimulatedRank(num_shards, rank), data, validation_data=batches_of(count))
        else:
            data = getattr(inputs, purpose)(SimulatedRank(num_shards, rank), data)
        ranks.append((data, [row_ids(x) for x, _ in data.x]))
    if count == 0:
        return [] if all(not batches for _, batches in ranks) else ["batches out of nothing"]
    failures = []
    if purpose == "fit_validation_data":
        if len({len(batches) for _, batches in ranks}) != 1:
            failures.append(f"train shards differ in steps: {[len(b) for _, b in ranks]}")
        if sorted({i for _, batches in ranks for b in batches for i in b}) != list(range(total)):
            failures.append("train shards do not cover every row")
    elif purpose == "evaluate":
        counted = sorted(i for data, batches in ranks if not data.stand_in for b in batches for i in b)
        if counted != list(range(total)):
            failures.append(f"evaluate counts {counted}, not each row once")
        if any(not batches for _, batches in ranks):
            failures.append("an empty share reaches Keras")
    else:
        per_shard = [np.array(sum(batches, []), dtype="float32") for _, batches in ranks]
        sizes = ranks[0][0].generator_share.batch_sizes if num_shards > 1 else [len(per_shard[0])]
        order = reassemble(per_shard, sizes).tolist()
        if order != list(range(total)):
            failures.append(f"predict reassembles rows {order}, not 0..{total - 1}")
    return failures


SEEN = []  # what each train step got (`describe`), as Keras traced or ran it


def describe(data):
    """The nesting of `data`, and each leaf's type, dtype and rank, as a string."""
    if isinstance(data, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in sorted(data.items())) + "}"
    if isinstance(data, (list, tuple)):
        return f"{type(data).__name__}(" + ", ".join(describe(part) for part in data) + ")"
    if data is None:
        return "None"
    return f"{type(data).__name__} {keras.backend.standardize_dtype(data.dtype)} rank {len(data.shape)}"


def make_model(x, y):
    # A plain structure, out of Keras's tracking; without y, one output and a loss of its own.
    outputs = tree.map_structure(lambda _: None, y) if y is not None else None

    class Flatten(keras.Model):
        """One Dense over every input leaf, one output per y leaf: any structure in and out."""

        def __init__(self):
            super().__init__()
            self.flat_heads = [keras.layers.Dense(1) for _ in (tree.flatten(outputs) if y is not None else [y])]

        def call(self, inputs):
            leaves = [keras.ops.reshape(keras.ops.cast(a, "float32"), (keras.ops.shape(a)[0], -1))
                      for a in tree.flatten(inputs)]
            features = keras.ops.concatenate(leaves, axis=1) if len(leaves) > 1 else leaves[0]
            heads = [head(features) for head in self.flat_heads]
            if y is None:
                self.add_loss(keras.ops.mean(heads[0] ** 2))
                return heads[0]
            return tree.pack_sequence_as(outputs, heads)

        if BACKEND == "jax":
            def train_step(self, state, data):
                SEEN.append(describe(data))
                return super().train_step(state, data)
        else:
            def train_step(self, data):
                SEEN.append(describe(data))
                return super().train_step(data)

    model = Flatten()
    model.compile(optimizer="sgd", loss="mse" if y is not None else None, run_eagerly=BACKEND != "jax")
    return model


def run_keras(purpose, structure, length, num_shards):
    """Keras's own fit / evaluate / predict on every rank's share: the failures, as strings."""
    (x, y, weights), ranks = split(purpose, structure, length, num_shards)
    failures = []
    for rank, (data, validation) in enumerate(ranks):
        model = make_model(x, y)
        try:
            if purpose.startswith("fit"):
                model.fit(data.x, data.y, sample_weight=data.sample_weight, batch_size=data.batch_size,
                          validation_data=inputs.as_validation_data(validation), epochs=1, verbose=0)
            elif purpose == "evaluate":
                model.evaluate(data.x, data.y, sample_weight=data.sample_weight, batch_size=data.batch_size, verbose=0)
            else:
                out = model.predict(data.x, batch_size=data.batch_size, verbose=0)
                if {len(leaf) for leaf in tree.flatten(out)} != {len(row_ids(data.x))}:
                    failures.append(f"rank {rank}: predict returned other lengths")
        except Exception as exc:  # reported, not raised: one case's failure must not hide the others
            failures.append(f"rank {rank}: Keras {purpose}: {type(exc).__name__}: {str(exc)[:300]}")
    return failures


def run_ordered(structure, length, num_shards):
    """Keras's `fit` on every rank's share in the order keras_dist draws: the failures, as strings.

    Each step must get what Keras's array adapter gives one process for the same arrays.
    """
    x, y, weights = STRUCTURES[structure](length)
    SEEN.clear()
    make_model(x, y).fit(x, y, sample_weight=weights, batch_size=2, epochs=1, shuffle=True, verbose=0)
    expected, failures = set(SEEN), []
    for rank in range(num_shards):
        data, _ = inputs.fit(SimulatedRank(num_shards, rank), inputs.Inputs(x, y, weights, batch_size=2),
                             position=EpochPosition(seed=3), shuffle=True)
        if not data.ordered:
            failures.append(f"rank {rank}: not ordered by keras_dist")
        SEEN.clear()
        try:
            make_model(x, y).fit(data.x, data.y, sample_weight=data.sample_weight, batch_size=data.batch_size,
                                 steps_per_epoch=data.steps, epochs=1, verbose=0)
        except Exception as exc:  # reported, not raised: one case's failure must not hide the others
            failures.append(f"rank {rank}: Keras fit: {type(exc).__name__}: {str(exc)[:300]}")
            continue
        if set(SEEN) != expected:
            failures.append(f"rank {rank}: train_step got {sorted(set(SEEN))}, Keras's array adapter gives "
                            f"{sorted(expected)}")
    return failures


def main():
    cases, failures = 0, []
    for structure in STRUCTURES:
        for purpose in PURPOSES:
            for num_shards in PROCESSES:
                for length in SIZES:
                    cases += 1
                    failures += [f"{structure} {purpose} n={length} N={num_shards}: {f}"
                                 for f in check(purpose, structure, length, num_shards)]
            cases += 1
            failures += [f"{structure} {purpose} n=7 N=2 (Keras): {f}" for f in run_keras(purpose, structure, 7, 2)]
        for num_shards in (1, 2):
            cases += 1
            failures += [f"{structure} fit shuffled n=7 N={num_shards} (ordered, Keras): {f}"
                         for f in run_ordered(structure, 7, num_shards)]
    for purpose in ("fit_validation_data", "evaluate", "predict"):
        for num_shards in PROCESSES:
            for count in range(8):
                cases += 1
                failures += [f"generator {purpose} {count} batches N={num_shards}: {f}"
                             for f in check_generator(purpose, count, num_shards)]
    print(json.dumps({"backend": BACKEND, "cases": cases, "failures": failures}))


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.exit(main())
