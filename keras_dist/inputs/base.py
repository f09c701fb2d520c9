"""What every input kind shares: the call's input (`Inputs`), the contract each kind
implements (`InputKind`), the step each kind's `ordered` ends with, and the open-ended input
of collective steps.

Each kind Keras accepts has a module under `keras_dist.inputs` with its `InputKind`, and a
line in `keras_dist.inputs.KINDS` that recognises it and imports its module.
"""

import abc
import dataclasses
import itertools
import os
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from keras_dist.inputs.position import EpochPosition
    from keras_dist.replicas import InputPlan, Replicas

# The argument that bounds a call's steps, by purpose, as Keras names it.
STEPS = {"fit": "steps_per_epoch", "validation": "validation_steps", "evaluate": "steps", "predict": "steps"}


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
        kind: the input's kind, once split (its `gather` puts predictions back in order).
        class_weight: `fit`'s, kept beside the input it weighs.
    """

    x: Any
    y: Any = None
    sample_weight: Any = None
    batch_size: int | None = None
    steps: int | None = None
    samples: int | None = None
    stand_in: bool = False
    generator_share: Any = None  # a `keras_dist.inputs.generators.GeneratorShare`
    ordered: bool = False
    kind: "InputKind | None" = None
    class_weight: dict | None = None

    @classmethod
    def of_validation(cls, validation_data: Any, batch_size: int | None, steps: int | None) -> "Inputs":
        # As Keras reads it: a tuple is (x, y[, sample_weight]); anything else (a dataset, a
        # PyDataset, a DataLoader) yields its own batches.
        data = tuple(validation_data) if isinstance(validation_data, (tuple, list)) else (validation_data,)
        return cls(*data, batch_size=batch_size, steps=steps)

    @property
    def arrays(self) -> dict:
        """x, y and sample_weight by name, as the array functions take them."""
        return {"x": self.x, "y": self.y, "sample_weight": self.sample_weight}

    def arguments(self, steps: str) -> dict:
        """Keras's keyword arguments for this input, the step bound named `steps`."""
        return {**self.arrays, "batch_size": self.batch_size, steps: self.steps}


class InputKind(abc.ABC):
    """How keras_dist splits one kind of input Keras accepts, for the process `replicas` is."""

    @abc.abstractmethod
    def split(self, replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's share of `data` (`pad`: equal steps on every process, for training;
        `purpose`: "fit", "validation", "evaluate" or "predict")."""

    def ordered(self, replicas: "Replicas", data: Inputs, position: "EpochPosition",
                shuffle: bool | str) -> Inputs | None:
        """The training share in an order keras_dist draws, which resumes inside an epoch
        (`ordered_share`); None (the default): the kind's order is its own."""
        return None

    @abc.abstractmethod
    def gather(self, replicas: "Replicas", data: Inputs, outputs: Any) -> Any:
        """Every process's `predict` outputs of the split `data`, in the script's input order."""


# The datasets of shards that give every process batches of the same number and sizes.
_EQUAL_STEPS: "weakref.WeakSet[Any]" = weakref.WeakSet()


def mark_equal_steps(dataset: Any) -> None:
    """Says that `dataset`, one process's shard, gives batches of the same number and sizes as
    every other process's (`InputPlan.marks_equal_steps`)."""
    _EQUAL_STEPS.add(dataset)


def has_equal_steps(dataset: Any) -> bool:
    """Whether `mark_equal_steps` marked `dataset`."""
    return dataset in _EQUAL_STEPS


def may_stand_in(plan: "InputPlan", pad: bool) -> bool:
    """Whether an unpadded share may be empty and get a stand-in; where steps are collectives
    an open-ended input ends it instead (`open_ended`)."""
    return plan.num_shards > 1 and not pad and not plan.collective_steps


def open_ended(dataset: Any) -> Any:
    """A `tf.data.Dataset` as one whose length TensorFlow cannot know in advance: Keras then
    iterates until the distributed iterator ends, which it does on every worker together
    (unpadded shards of different lengths where steps are collectives); a known length
    would stop workers with shorter shards early."""
    return dataset.filter(lambda *_: True)


def ordered_share(x: Any, data: Inputs, position: "EpochPosition") -> Inputs:
    """The training input `x` that keras_dist orders: it starts the epoch resumed after the
    part done itself (`EpochPosition.sources_skip`)."""
    position.sources_skip = True
    return Inputs(x, steps=data.steps, ordered=True)


_calls = itertools.count()


def job_seed(replicas: "Replicas") -> int:
    """The seed of one call's epoch orders, the same on every process (the chief's).

    From the script's seed (`keras.utils.set_random_seed`) and the number of calls
    before, so that a seeded script draws the same orders when run again; otherwise
    from the OS.
    """
    from keras_dist.keras_internals import get_random_seed

    script_seed = get_random_seed()
    base = int.from_bytes(os.urandom(4), "little") if script_seed is None else script_seed
    seed = int(np.random.SeedSequence([base, next(_calls)]).generate_state(1)[0])
    return replicas.collectives.broadcast_object(seed)
