"""Where one `fit` stands in its epochs, and the rule that splits the rest of an epoch.

Owned by the inputs keras_dist orders (arrays, PyDatasets of known length, DataLoaders it
splits): they read the epoch under way and where it starts from an `EpochPosition`, which
`keras_dist.fault_tolerance.resume` saves with each backup and sets again on restart.

An input that can resume on another number of processes counts its place in an epoch's
order in units (samples, or a PyDataset's batches) and declares itself the position's
`resizable` (`ResizableEpochs`): the rest of the interrupted epoch's order, after the
units done, is split among the processes now present (`rest_of_order`), so no unit is
trained twice or never, whatever the count before.
"""

import dataclasses
from typing import Protocol

import numpy as np


class ResizableEpochs(Protocol):
    """An input whose epochs split the rest of their order anew on each process count."""

    length: int  # the units of an epoch's order
    unit: str  # what a unit is, for the resume line: "samples", "batches"

    @property
    def steps(self) -> int:
        """The steps of a whole epoch on this process count."""

    def steps_after(self, done: int) -> int:
        """The steps of an epoch that starts after `done` units of its order."""


@dataclasses.dataclass
class EpochPosition:
    """Where one `fit` stands: shared by `ResumePoint` and the inputs keras_dist orders.

    Args:
        seed: the job's seed for the epochs' orders, the same on every process.
        epoch: the epoch under way.
        resume_epoch: the epoch a restarted fit resumes inside (-1: none).
        skip: the steps of `resume_epoch` that Keras's loop leaves out (those done before
            the restart, counted on this run's process count).
        skip_samples: the units of `resume_epoch`'s order done before the restart.
        sources_skip: the training input starts `resume_epoch` after them itself;
            otherwise the consumed batches are read and dropped.
        resizable: the training input, where it can resume on another number of processes.
        step_samples: the units of its order one step takes over all processes, where known.
        elastic: the job may restart on another number of processes (`--nnodes MIN:MAX`):
            inputs keras_dist can order for that are ordered even where nothing else asks
            (arrays that `fit` does not shuffle).
    """

    seed: int
    epoch: int = 0
    resume_epoch: int = -1
    skip: int = 0
    skip_samples: int = 0
    sources_skip: bool = False
    resizable: ResizableEpochs | None = None
    step_samples: int | None = None
    elastic: bool = False
    # Iterations over the training input begun since training began (`next_iteration`).
    iterations: int = 0

    def first_step(self, epoch: int) -> int:
        """The step `epoch` starts at: `skip` in the epoch resumed, else 0."""
        return self.skip if epoch == self.resume_epoch else 0

    def first_sample(self, epoch: int) -> int:
        """The place in `epoch`'s order it starts at: `skip_samples` in the epoch resumed, else 0."""
        return self.skip_samples if epoch == self.resume_epoch else 0

    def order(self, epoch: int, length: int) -> np.ndarray:
        """Epoch `epoch`'s permutation of `length` samples (or batches): a function of the seed and epoch alone."""
        return np.random.default_rng([self.seed, epoch]).permutation(length)

    def next_iteration(self) -> int:
        """The epoch of an iteration over the training input begun now.

        For inputs that begin an epoch's iteration before its `on_epoch_begin` (a
        `DataLoader` with workers starts the next epoch's as the last one ends): the
        k-th iteration since training began is epoch `resume_epoch + k`.
        """
        epoch = max(self.resume_epoch, 0) + self.iterations
        self.iterations += 1
        return epoch


def rest_of_order(order: np.ndarray, done: int, num_shards: int) -> np.ndarray:
    """What is left of an epoch's `order` after `done` units, padded to a multiple of
    `num_shards` with units from the order's start (repeated where it is shorter), as
    `DistributedSampler` pads: shard r then takes `rest[r::num_shards]`."""
    rest = order[done:]
    missing = (-len(rest)) % num_shards
    return np.concatenate([rest, np.resize(order, missing)]) if missing and len(order) else rest


def steps_left(length: int, done: int, num_shards: int, batch_size: int) -> int:
    """The steps of an epoch of `length` units that starts after `done`, each process taking
    `batch_size` units a step (the last batch may be short)."""
    per_shard = -(-(length - done) // num_shards)
    return -(-per_shard // batch_size)
