"""The one home of input: what each process reads for `fit`, its validation, `evaluate` and `predict`.

Keras routes a call's input from its trainer through a data adapter to the distribution;
keras_dist splits it once, before that route starts, by one rule for every kind Keras
accepts: element i goes to replica i mod N, the batch size stays per replica, training
shards are padded so every replica runs the same number of steps, and evaluation and
prediction shards are not (every example counts once). Element i is the i-th of the
epoch's order: where `fit` shuffles, keras_dist draws one permutation of the whole input
per epoch (from the job's seed and the epoch, as `DistributedSampler.set_epoch`) and
splits that, so each replica's batches are a uniform sample of the data set, different
every epoch, never a fixed stride of it (docs/semantics.md). Each kind has its module, and
only the module of a kind imports its framework:

* arrays (NumPy, or anything with `__array__`): `keras_dist.inputs.arrays`;
* `tf.data.Dataset`: `keras_dist.inputs.tf_data` (rewrites the pipeline so each process
  reads and preprocesses only its share);
* `keras.utils.PyDataset`: `keras_dist.inputs.py_dataset`;
* torch `DataLoader`: `keras_dist.inputs.data_loader` (as `DistributedSampler` splits);
* Python generators: `keras_dist.inputs.generators` (every N-th batch of the stream).

A strategy says how its process reads (`Strategy.input_plan`) and sees every shard once,
through `Strategy.take_input`, before Keras does.
"""

import dataclasses
import itertools
import os
import sys
import types
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError
from keras_dist.inputs import arrays
from keras_dist.inputs.generators import GeneratorShare, reassemble
from keras_dist.inputs.position import EpochPosition
from keras_dist.inputs.py_dataset import ShardedPyDataset

if TYPE_CHECKING:
    import tensorflow as tf

    from keras_dist.strategies.base import Strategy

# The argument that bounds a call's steps, by purpose, as Keras names it.
_STEPS = {"fit": "steps_per_epoch", "validation": "validation_steps", "evaluate": "steps", "predict": "steps"}


@dataclasses.dataclass(frozen=True)
class Inputs:
    """One call's input, as Keras's data adapters take it.

    Args:
        x, y, sample_weight: as `fit` takes them (y and sample_weight only with arrays).
        batch_size: per process, once split (Keras's default where None).
        steps: the call's bound on steps (`steps_per_epoch`, `validation_steps`, `steps`).
        samples: arrays split with padding for `predict`: the number of samples before the
            split, which the gathered outputs are cut back to.
        stand_in: this process's unpadded share is empty (fewer samples than
            processes): one sample or batch stands in, so that Keras's loop builds and runs
            as on the others; its metric states are not counted and its predictions are
            dropped (`DistributedTraining`).
        generator_share: a generator split for `predict`, whose batch sizes put the
            gathered outputs back in order.
        ordered: keras_dist orders the epochs (`fit` that resumes inside an epoch): Keras
            must not shuffle.
    """

    x: Any
    y: Any = None
    sample_weight: Any = None
    batch_size: int | None = None
    steps: int | None = None
    samples: int | None = None
    stand_in: bool = False
    generator_share: GeneratorShare | None = None
    ordered: bool = False

    @classmethod
    def of_validation(cls, validation_data: Any, batch_size: int | None, steps: int | None) -> "Inputs":
        # As Keras reads it: a tuple is (x, y[, sample_weight]); anything else (a dataset, a
        # PyDataset, a DataLoader) yields its own batches.
        data = tuple(validation_data) if isinstance(validation_data, (tuple, list)) else (validation_data,)
        return cls(*data, batch_size=batch_size, steps=steps)

    def as_validation_data(self) -> Any:
        """What `fit` takes as `validation_data`."""
        return (self.x, self.y, self.sample_weight) if arrays.is_array_input(self.x) else self.x

    def arguments(self, steps: str) -> dict:
        """Keras's keyword arguments for this input, the step bound named `steps`."""
        return {"x": self.x, "y": self.y, "sample_weight": self.sample_weight, "batch_size": self.batch_size,
                steps: self.steps}


def fit(strategy: "Strategy", data: Inputs, validation_data: Any = None, validation_split: float = 0.0,
        validation_batch_size: int | None = None, validation_steps: int | None = None,
        position: EpochPosition | None = None, shuffle: bool | str = False) -> tuple[Inputs, Inputs | None]:
    """This process's training input (padded to equal steps) and validation input (None: none).

    With `position` (a fit that may resume inside an epoch, `keras_dist.fault_tolerance.resume`,
    or that several processes run), inputs whose order keras_dist can draw (arrays, a
    PyDataset of known length, a DataLoader it splits) are ordered by it, one global
    permutation per shuffled epoch, and start an epoch resumed after the part done
    themselves (`Inputs.ordered`, `EpochPosition.sources_skip`), on any process count
    (`EpochPosition.resizable`).
    """
    if validation_split and validation_data is None and arrays.is_array_input(data.x):
        data, validation_data = _hold_out(data, validation_split)
    validation = None
    if validation_data is not None:
        held = Inputs.of_validation(validation_data, validation_batch_size or data.batch_size, validation_steps)
        validation = _split(strategy, held, pad=False, purpose="validation")
    ordered = _ordered(strategy, data, position, shuffle) if position is not None and data.steps is None else None
    return ordered or _split(strategy, data, pad=True, purpose="fit"), validation


def evaluate(strategy: "Strategy", data: Inputs) -> Inputs:
    """This process's share of `evaluate`'s input (not padded)."""
    return _split(strategy, data, pad=False, purpose="evaluate")


def predict(strategy: "Strategy", data: Inputs) -> Inputs:
    """This process's share of `predict`'s input (files never split, to keep the order).

    Arrays are padded to equal shards, so that no process runs Keras's loop on nothing
    (fewer samples than processes) and steps end together; the gather drops the padding.
    Other kinds give an empty share a stand-in batch (`Inputs.stand_in`).
    """
    return _split(strategy, data, pad=False, purpose="predict")


def gather_predictions(strategy: "Strategy", data: Inputs, outputs: Any) -> Any:
    """Every process's `predict` outputs for the split `data`, in the script's input order."""
    if strategy.input_plan.num_shards == 1:
        return outputs
    if data.generator_share is not None:
        sizes = data.generator_share.batch_sizes
        return tree.map_structure(lambda leaf: reassemble(arrays.allgather_parts(strategy, leaf), sizes), outputs)
    if isinstance(data.x, ShardedPyDataset):  # consecutive batches: in rank order
        return tree.map_structure(lambda leaf: strategy.allgather_array(np.asarray(leaf)), outputs)
    return arrays.gather_interleaved(strategy, outputs, strategy.input_plan.num_shards, data.samples)


def distribute_dataset(dataset: "tf.data.Dataset", training: bool = True) -> "tf.data.Dataset":
    """This process's share of `dataset`, as keras_dist's `fit` (or `evaluate`) reads it.

    For loops of your own, and to see what each worker reads: a batched dataset whose
    batch size is per replica, split as described in `keras_dist.inputs`.

    Args:
        dataset: a batched `tf.data.Dataset`, the same on every process.
        training: pad the shards to equal length, as `fit` does (collective; every
            process must call it).

    Example:

    ```python
    for x, y in keras_dist.distribute_dataset(dataset):
        ...
    ```
    """
    from keras_dist import runtime
    from keras_dist.inputs import tf_data

    strategy = runtime.current()
    plan = strategy.input_plan
    shard, _ = tf_data.shard_dataset(dataset, plan.num_shards, plan.shard_index, training, plan.batch_multiplier,
                                     allgather=strategy.allgather_object)
    return shard


def is_tf_dataset(data: Any) -> bool:
    """Whether `data` is a `tf.data.Dataset` (without importing TensorFlow: none exists before it is)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def is_data_loader(data: Any) -> bool:
    """Whether `data` is a `torch.utils.data.DataLoader` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.utils.data.DataLoader)


def _hold_out(data: Inputs, fraction: float) -> tuple[Inputs, tuple]:
    """Keras's `validation_split`, taken before the split as one process would: the last fraction."""
    kept, held = arrays.hold_out((data.x, data.y, data.sample_weight), fraction)
    return dataclasses.replace(data, x=kept[0], y=kept[1], sample_weight=kept[2]), held


def _ordered(strategy, data: Inputs, position: EpochPosition, shuffle: bool | str) -> Inputs | None:
    """This process's training share of `data`, ordered by keras_dist (a fit that may resume
    inside an epoch, or that several processes run): each epoch that `fit` shuffles is one
    permutation of the whole input, drawn from the job's seed and the epoch, split
    interleaved; None where keras_dist cannot order it (`_split` splits it then)."""
    plan, x = strategy.input_plan, data.x
    if isinstance(x, keras.utils.PyDataset) and x.num_batches is not None:
        x = ShardedPyDataset(x, plan.num_shards, plan.shard_index, True, plan.batch_multiplier,
                             position=position, shuffle=bool(shuffle))
    elif is_data_loader(x):
        from keras_dist.inputs import data_loader

        if data_loader.is_split(x):
            return None
        x = _split_data_loader(strategy, x, True, position)
    elif x is not None and arrays.is_array_input(x) and (shuffle != "batch" or plan.num_shards > 1):
        # Under several processes "batch" (Keras: shuffle within batch-sized chunks) draws one
        # global permutation too: any order kept inside a chunk gives each shard a fixed stride.
        parts = {"x": x, "y": data.y, "sample_weight": data.sample_weight}
        if arrays.num_samples(parts) == 0:
            return None
        x = arrays.EpochRows(parts, plan.num_shards, plan.shard_index, (data.batch_size or 32) * plan.batch_multiplier,
                             position, shuffle=bool(shuffle))
    else:
        return None
    position.sources_skip = True
    return Inputs(strategy.take_input(x, True), steps=data.steps, ordered=True)


def _split(strategy, data: Inputs, pad: bool, purpose: str) -> Inputs:
    """This process's share of `data`, as the strategy then takes it."""
    plan = strategy.input_plan
    x, equal_steps = data.x, False
    # An unpadded share may be empty; where steps are collectives the open-ended input ends it.
    may_stand_in = plan.num_shards > 1 and not pad and not plan.collective_steps
    if is_tf_dataset(x):
        from keras_dist.inputs import tf_data

        if plan.num_shards > 1 and data.steps is None and tf_data.is_infinite(x):
            caller = "fit" if purpose == "validation" else purpose
            raise KerasDistError(f"the dataset is infinite (it repeats); pass {_STEPS[purpose]} to {caller}")
        # With a step count the epoch ends there; without, shards are padded to equal steps.
        source = x
        x, equal_steps = tf_data.shard_dataset(x, plan.num_shards, plan.shard_index, pad and data.steps is None,
                                               plan.batch_multiplier, files=purpose != "predict",
                                               allgather=strategy.allgather_object)
        if may_stand_in and tf_data.is_empty(x):
            x = source.take(1)  # the first batch stands in for an empty share
            data = dataclasses.replace(data, stand_in=True)
        data = dataclasses.replace(data, x=x)
    elif isinstance(x, keras.utils.PyDataset):
        if plan.num_shards > 1 or plan.batch_multiplier > 1:
            # Collective steps end together through `equal_steps`, so no open-ended input.
            x = ShardedPyDataset(x, plan.num_shards, plan.shard_index, pad, plan.batch_multiplier,
                                 contiguous=purpose == "predict", equal_steps=pad or plan.collective_steps)
            data = dataclasses.replace(data, stand_in=x.stand_in)
        return dataclasses.replace(data, x=strategy.take_input(x, False))
    elif is_data_loader(x):
        if plan.num_shards > 1 or plan.batch_multiplier > 1:
            x = _split_data_loader(strategy, x, pad)
            data = dataclasses.replace(data, stand_in=getattr(x.sampler, "stand_in", False))  # a DistributedSampler: none
        return dataclasses.replace(data, x=strategy.take_input(x, False))
    elif x is not None and arrays.is_array_input(x):
        parts = {"x": x, "y": data.y, "sample_weight": data.sample_weight}
        if purpose == "predict" and plan.num_shards > 1:
            pad = True
            data = dataclasses.replace(data, samples=arrays.num_samples(parts))
        split = arrays.shard_arrays(parts, plan.num_shards, plan.shard_index, pad)
        if may_stand_in and arrays.num_samples(split) == 0:
            split = arrays.take_rows(parts, np.zeros(1, dtype=int))
            data = dataclasses.replace(data, stand_in=True)
        batch_size = None if data.batch_size is None else data.batch_size * plan.batch_multiplier
        data, equal_steps = dataclasses.replace(data, **split, batch_size=batch_size), pad
    elif isinstance(x, types.GeneratorType):
        if plan.num_shards > 1:
            data = _split_generator(strategy, data, pad or purpose == "predict", purpose)
        return dataclasses.replace(data, x=strategy.take_input(data.x, False))
    elif plan.num_shards > 1:
        raise KerasDistError(
            f"keras_dist cannot split a {type(x).__name__} across {plan.num_shards} processes; "
            "pass NumPy arrays, a tf.data.Dataset, a keras.utils.PyDataset or a torch DataLoader"
        )
    else:
        return data
    if not pad and plan.collective_steps:
        from keras_dist.inputs import tf_data

        # Shards of different lengths: one open-ended dataset, which every worker ends together.
        source = data.x if is_tf_dataset(data.x) else {"x": data.x, "y": data.y, "sample_weight": data.sample_weight}
        data = Inputs(tf_data.open_ended(source, data.batch_size), steps=data.steps)
    return dataclasses.replace(data, x=strategy.take_input(data.x, equal_steps))


def _split_generator(strategy, data: Inputs, pad: bool, purpose: str) -> Inputs:
    plan = strategy.input_plan
    if plan.collective_steps or plan.batch_multiplier > 1:
        raise KerasDistError(f"backend {strategy.name!r} cannot split a Python generator (each process "
                             "would feed several replicas or steps are collectives); pass NumPy arrays, "
                             "a tf.data.Dataset or a keras.utils.PyDataset")
    share = GeneratorShare(data.x, plan.num_shards, plan.shard_index, pad)
    return dataclasses.replace(data, x=share.batches(), stand_in=share.stand_in,
                               generator_share=share if purpose == "predict" else None)


def _split_data_loader(strategy, loader, pad: bool, position: EpochPosition | None = None):
    from keras_dist.inputs import data_loader

    if data_loader.is_split(loader):
        return loader  # by the script, with a DistributedSampler
    if strategy.input_plan.collective_steps:
        raise KerasDistError(f"backend {strategy.name!r} cannot read a torch DataLoader (its steps are "
                             "collectives); pass NumPy arrays, a tf.data.Dataset or a keras.utils.PyDataset")
    if position is None and data_loader.shuffles(loader):
        position = EpochPosition(seed=job_seed(strategy))  # drawn anew for each call
    plan = strategy.input_plan
    return data_loader.shard_data_loader(loader, plan.num_shards, plan.shard_index, pad, plan.batch_multiplier,
                                         position)


_calls = itertools.count()


def job_seed(strategy: "Strategy") -> int:
    """The seed of one call's epoch orders, the same on every process (the chief's).

    From the script's seed (`keras.utils.set_random_seed`) and the number of calls
    before, so that a seeded script draws the same orders when run again; otherwise
    from the OS.
    """
    from keras_dist.keras_internals import get_random_seed

    script_seed = get_random_seed()
    base = int.from_bytes(os.urandom(4), "little") if script_seed is None else script_seed
    seed = int(np.random.SeedSequence([base, next(_calls)]).generate_state(1)[0])
    return strategy.broadcast_object(seed)
