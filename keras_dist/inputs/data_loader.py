"""PyTorch `DataLoader` sharding: each process loads only its share, as `DistributedSampler` does.

A loader over a map-style dataset is rebuilt around the same dataset, `collate_fn`,
workers and options, with a sampler that gives sample i to shard i mod N (the rule
`keras_dist.inputs` states for every input). Its batch size is the script's times the
replicas this process feeds. A shuffling loader (`shuffle=True`) draws one permutation
per epoch from a seed every process shares, then takes its interleaved share of it, so
no sample is read twice or never. Training shards are padded to equal length by wrapping
around, as `DistributedSampler` pads; evaluation and prediction shards are not.
Imported only where the input is a `DataLoader` (so torch is installed).
"""

import dataclasses
from typing import TYPE_CHECKING

import numpy as np
from torch.utils import data

from keras_dist.errors import KerasDistError
from keras_dist.inputs.arrays import InterleavedOutputs
from keras_dist.inputs.base import Inputs, job_seed, ordered_share
from keras_dist.inputs.position import EpochPosition, rest_of_order, steps_left

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas


class DataLoaderKind(InterleavedOutputs):
    """A torch `DataLoader`, split as `DistributedSampler` splits."""

    def split(self, replicas: "Replicas", inputs: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's samples, in a loader rebuilt around the script's dataset."""
        loader, plan = inputs.x, replicas.input_plan
        if plan.num_shards > 1 or plan.batch_multiplier > 1:
            loader = _share(replicas, loader, pad)
            # A DistributedSampler of the script's has no stand-in.
            inputs = dataclasses.replace(inputs, stand_in=getattr(loader.sampler, "stand_in", False))
        return dataclasses.replace(inputs, x=loader)

    def ordered(self, replicas: "Replicas", inputs: Inputs, position: EpochPosition, shuffle: bool | str) -> Inputs | None:
        """The training share in keras_dist's order, unless the script split the loader itself."""
        if is_split(inputs.x):
            return None
        return ordered_share(_share(replicas, inputs.x, True, position), inputs, position)


def _share(replicas: "Replicas", loader: data.DataLoader, pad: bool,
           position: EpochPosition | None = None) -> data.DataLoader:
    if is_split(loader):
        return loader  # by the script, with a DistributedSampler
    if replicas.input_plan.collective_steps:
        raise KerasDistError(f"backend {replicas.name!r} cannot read a torch DataLoader (its steps are "
                             "collectives); pass NumPy arrays, a tf.data.Dataset or a keras.utils.PyDataset")
    if position is None and shuffles(loader):
        position = EpochPosition(seed=job_seed(replicas))  # drawn anew for each call
    plan = replicas.input_plan
    return shard_data_loader(loader, plan.num_shards, plan.shard_index, pad, plan.batch_multiplier, position)


class InterleavedSampler(data.Sampler):
    """Indices `index, index + N, ...` of `length` samples, or of one shared permutation per epoch.

    Args:
        length: the dataset's number of samples.
        num_shards: N, the shards the dataset is split into.
        index: this shard.
        pad: repeat samples from the start so every shard has the same length.
        position: the fit's `EpochPosition` (None: the dataset's order, every epoch from
            its start). Each iteration takes the next epoch's (`next_iteration`); the
            epoch a fit resumes inside starts after the samples done, the rest split
            among this run's shards, however many there were before: with padding, the
            sampler is the position's `resizable`.
        shuffle: each epoch in `position`'s permutation for it, the same on every process.
        batch_size: the loader's batch size, by which an epoch counts its steps.

    Unpadded, a shard with no sample of its own (fewer samples than shards) gives the
    first sample as a stand-in (`stand_in`), which keras_dist does not count.
    """

    unit = "samples"

    def __init__(self, length: int, num_shards: int, index: int, pad: bool, position: EpochPosition | None = None,
                 shuffle: bool = False, batch_size: int = 1):
        super().__init__()
        self.length, self.num_shards, self.index, self.pad = length, num_shards, index, pad
        self.position, self.shuffle, self.batch_size = position, shuffle, batch_size
        self.stand_in = not pad and 0 < length <= index

    @property
    def steps(self) -> int:
        return self.steps_after(0)

    def steps_after(self, done: int) -> int:
        return steps_left(self.length, done, self.num_shards, self.batch_size)

    def __iter__(self):
        done, order = 0, np.arange(self.length)
        if self.position is not None:
            # Counted, not read from the epoch under way: a loader with workers begins the
            # next epoch's iteration as the last one ends.
            epoch = self.position.next_iteration()
            if self.shuffle:
                order = self.position.order(epoch, self.length)
            done = self.position.first_sample(epoch)
        if self.stand_in:
            return iter(order[:1].tolist())
        if self.pad:  # training; evaluation and prediction never resume (done is 0)
            order = rest_of_order(order, done, self.num_shards)
        return iter(order[self.index::self.num_shards].tolist())

    def __len__(self) -> int:
        if self.stand_in:
            return 1
        if self.pad:
            return -(-self.length // self.num_shards)
        return len(range(self.index, self.length, self.num_shards))


def shuffles(loader: data.DataLoader) -> bool:
    """Whether `loader` draws a new order every epoch (`shuffle=True`); a one-line error
    where keras_dist cannot split it."""
    if isinstance(loader.dataset, data.IterableDataset):
        raise KerasDistError(
            f"keras_dist cannot split a DataLoader over an IterableDataset ({type(loader.dataset).__name__}) across "
            "processes; give the loader a map-style Dataset (__len__ and __getitem__), or pass NumPy arrays, a "
            "tf.data.Dataset or a keras.utils.PyDataset"
        )
    if loader.batch_size is None:
        raise KerasDistError("keras_dist cannot split a DataLoader with a batch_sampler across processes; pass "
                             "batch_size= and shuffle= instead, or a DistributedSampler of your own")
    sampler = loader.sampler
    if isinstance(sampler, data.RandomSampler) and not sampler.replacement and sampler._num_samples is None:
        return True
    if isinstance(sampler, data.SequentialSampler):
        return False
    raise KerasDistError(f"keras_dist cannot split a DataLoader with a {type(sampler).__name__} across processes; "
                         "use shuffle=True or False, or a DistributedSampler of your own (then it is not split again)")


def is_split(loader: data.DataLoader) -> bool:
    """Whether the script split `loader` itself, with a `DistributedSampler`."""
    return isinstance(loader.sampler, data.distributed.DistributedSampler)


def shard_data_loader(loader: data.DataLoader, num_shards: int, index: int, pad: bool, batch_multiplier: int,
                      position: "EpochPosition | None") -> data.DataLoader:
    """Shard `index` of `loader`'s samples, in batches of its batch size times `batch_multiplier`.

    Args:
        loader: the script's loader, the same on every process.
        num_shards: the shards (processes that read).
        index: this process's shard.
        pad: equal shard lengths (training).
        batch_multiplier: the replicas this process feeds.
        position: the epochs' order and the step an epoch resumed starts at (None: the
            dataset's order, where the loader does not shuffle and fit does not resume).
    """
    shuffle = shuffles(loader)  # first: a one-line error for a loader that cannot be split
    batch_size = loader.batch_size * batch_multiplier
    sampler = InterleavedSampler(len(loader.dataset), num_shards, index, pad, position, shuffle, batch_size)
    if position is not None and pad:
        position.step_samples = batch_size * num_shards
        if not loader.drop_last:  # another count would drop other samples at the epoch's end
            position.resizable = sampler
    return data.DataLoader(
        loader.dataset, batch_size=batch_size, sampler=sampler,
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        drop_last=loader.drop_last, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
