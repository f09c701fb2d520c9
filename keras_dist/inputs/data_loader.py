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

import torch
from torch.utils import data

from keras_dist.errors import KerasDistError


class InterleavedSampler(data.Sampler):
    """Indices `index, index + N, ...` of `length` samples, or of one shared permutation per epoch.

    Args:
        length: the dataset's number of samples.
        num_shards: N, the shards the dataset is split into.
        index: this shard.
        seed: the seed of every epoch's permutation, the same on every process; None:
            the dataset's order.
        pad: repeat samples from the start so every shard has the same length.

    Unpadded, a shard with no sample of its own (fewer samples than shards) gives the
    first sample as a stand-in (`stand_in`), which keras_dist does not count.
    """

    def __init__(self, length: int, num_shards: int, index: int, seed: int | None, pad: bool):
        super().__init__()
        self.length, self.num_shards, self.index, self.seed, self.pad = length, num_shards, index, seed, pad
        self.stand_in = not pad and 0 < length <= index
        self.epoch = 0  # every process iterates its loader as often as the others

    def __iter__(self):
        if self.seed is None:
            order = list(range(self.length))
        else:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.length, generator=generator).tolist()
        self.epoch += 1
        if self.stand_in:
            return iter(order[:1])
        if self.pad:
            order += order[:(-self.length) % self.num_shards]
        return iter(order[self.index::self.num_shards])

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
                      seed: int | None) -> data.DataLoader:
    """Shard `index` of `loader`'s samples, in batches of its batch size times `batch_multiplier`.

    Args:
        loader: the script's loader, the same on every process.
        num_shards: the shards (processes that read).
        index: this process's shard.
        pad: equal shard lengths (training).
        batch_multiplier: the replicas this process feeds.
        seed: the permutations' seed, shared by every process, where the loader shuffles
            (`shuffles`); None: the dataset's order.
    """
    sampler = InterleavedSampler(len(loader.dataset), num_shards, index, seed, pad)
    return data.DataLoader(
        loader.dataset, batch_size=loader.batch_size * batch_multiplier, sampler=sampler,
        num_workers=loader.num_workers, collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
        drop_last=loader.drop_last, timeout=loader.timeout, worker_init_fn=loader.worker_init_fn,
        multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
        prefetch_factor=loader.prefetch_factor, persistent_workers=loader.persistent_workers,
        pin_memory_device=loader.pin_memory_device,
    )
