"""`keras.utils.PyDataset` sharding: each process loads only its share of the batches."""

import dataclasses
from typing import TYPE_CHECKING, Any

import keras
import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError
from keras_dist.inputs.arrays import gather_interleaved
from keras_dist.inputs.base import InputKind, Inputs, ordered_share
from keras_dist.inputs.position import EpochPosition, steps_left

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas


class PyDatasetKind(InputKind):
    """A `keras.utils.PyDataset`: every N-th batch index."""

    def split(self, replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's batches (`ShardedPyDataset`); for `predict`, consecutive runs of them."""
        plan, x = replicas.input_plan, data.x
        if plan.num_shards > 1 or plan.batch_multiplier > 1:
            # Collective steps end together through `equal_steps`, so no open-ended input.
            x = ShardedPyDataset(x, plan.num_shards, plan.shard_index, pad, plan.batch_multiplier,
                                 contiguous=purpose == "predict", equal_steps=pad or plan.collective_steps)
            data = dataclasses.replace(data, stand_in=x.stand_in)
        return dataclasses.replace(data, x=x)

    def ordered(self, replicas: "Replicas", data: Inputs, position: EpochPosition, shuffle: bool | str) -> Inputs | None:
        """The training batches in an order keras_dist draws per epoch, where the length is known."""
        if data.x.num_batches is None:
            return None
        plan = replicas.input_plan
        x = ShardedPyDataset(data.x, plan.num_shards, plan.shard_index, True, plan.batch_multiplier, position=position,
                             shuffle=bool(shuffle))
        return ordered_share(x, data, position)

    def gather(self, replicas: "Replicas", data: Inputs, outputs: Any) -> Any:
        """Predictions of consecutive runs of batches: concatenated in rank order."""
        if isinstance(data.x, ShardedPyDataset):
            return tree.map_structure(lambda leaf: replicas.collectives.allgather_array(np.asarray(leaf)), outputs)
        return gather_interleaved(replicas, outputs, replicas.input_plan.num_shards, data.samples)


class ShardedPyDataset(keras.utils.PyDataset):
    """One process's share of a `keras.utils.PyDataset`, split by batch index.

    Global step s takes the script's batches s*U ... s*U + U - 1, U = num_shards *
    batch_multiplier (one per replica), so N replicas at batch B see what one process at
    N*B does. This process concatenates its `batch_multiplier` batches of each step.
    With `equal_steps` every shard has the same number of steps: a training shard that
    runs short takes batches from the start again (fewer than U in all); otherwise it
    gets empty batches (where steps are collective, the strategy's step skips them).
    Without, a shard ends after its last batch of its own; a shard with none at all gets
    the first batch as a stand-in (`stand_in`, not counted: an empty batch would put NaN
    in Keras's loss tracker, 0/0, on every backend). With `contiguous` (prediction), shard
    r takes the r-th run of consecutive batches instead, so that outputs concatenated in
    rank order are in input order.

    Args:
        dataset: the script's PyDataset (its workers and queue settings are kept).
        num_shards: the number of shards (processes that read).
        index: this process's shard.
        pad: repeat batches rather than give empty ones (training).
        batch_multiplier: the replicas this process feeds.
        equal_steps: every shard takes the same number of steps (training, and steps
            that are collectives).
        contiguous: consecutive runs of batches instead of interleaved ones; needs a
            known length.
        position: for a `fit` that keras_dist orders (a known length, padded): the fit's
            `EpochPosition`, which starts an epoch resumed after the script's batches
            done, the rest split among this run's processes (however many there were
            before: the PyDataset is the position's `resizable`, its unit a batch) and,
            with `shuffle`, orders each epoch's batches: one permutation of all the
            script's batches, split as above, so no shard keeps a fixed stride of them
            (Keras's shuffle draws from Python's global random state, which a restarted
            process cannot bring back, and would only reorder this shard's own).
        shuffle: the script's `fit(shuffle=...)`, taken over with `position`.
    """

    def __init__(self, dataset: keras.utils.PyDataset, num_shards: int, index: int, pad: bool, batch_multiplier: int = 1,
                 contiguous: bool = False, equal_steps: bool = True, position: EpochPosition | None = None,
                 shuffle: bool = False) -> None:
        super().__init__(workers=dataset.workers, use_multiprocessing=dataset.use_multiprocessing,
                         max_queue_size=dataset.max_queue_size)
        self.dataset, self.pad, self.own, self.position, self.shuffle = dataset, pad, batch_multiplier, position, shuffle
        total = dataset.num_batches
        steps = None if total is None else -(-total // (num_shards * batch_multiplier))
        if contiguous and steps is None:
            raise KerasDistError("a PyDataset without a length cannot be split for predict; give it __len__")
        self.per_step = batch_multiplier if contiguous else num_shards * batch_multiplier
        self.first = index * batch_multiplier * (steps if contiguous else 1)
        self.stand_in = not equal_steps and total is not None and 0 < total <= self.first
        if not equal_steps and total is not None:
            # This shard's own steps; at least one, as Keras cannot evaluate an empty PyDataset.
            steps = max(1, min(steps, -(-(total - self.first) // self.per_step)))
        self.steps = steps
        self.length = total  # the units of a resizable epoch (the script's batches)
        self._order: tuple[int, np.ndarray] | None = None
        if position is not None:
            position.resizable, position.step_samples = self, self.per_step

    unit = "batches"

    def steps_after(self, done: int) -> int:
        return steps_left(self.length, done, self.per_step, 1)

    @property
    def num_batches(self) -> int | None:
        return self.steps

    def __getitem__(self, step):
        total, start = self.dataset.num_batches, 0
        if self.position is not None:
            start = self.position.first_sample(self.position.epoch)
            # Beyond the epoch's steps only where a prefetch reads ahead: wrapped, never used.
            step %= max(1, self.steps_after(start))
        wanted = [start + step * self.per_step + self.first + j for j in range(self.own)]
        if self.stand_in:
            wanted = [0]
        elif total is not None:
            wanted = [i % total for i in wanted] if self.pad else [i for i in wanted if i < total]
            if self.position is not None and self.shuffle:
                wanted = [int(i) for i in self._epoch_order(total)[wanted]]
        parts = [self.dataset[i] for i in wanted] or [tree.map_structure(lambda a: a[:0], self.dataset[0])]
        if len(parts) == 1:
            return parts[0]
        return tree.map_structure(lambda *leaves: np.concatenate(leaves), *parts)

    def _epoch_order(self, total: int) -> np.ndarray:
        """The permutation of the script's `total` batches for the epoch under way."""
        epoch = self.position.epoch
        if self._order is None or self._order[0] != epoch:
            self._order = epoch, self.position.order(epoch, total)
        return self._order[1]

    def on_epoch_begin(self) -> None:
        self.dataset.on_epoch_begin()

    def on_epoch_end(self) -> None:
        self.dataset.on_epoch_end()
