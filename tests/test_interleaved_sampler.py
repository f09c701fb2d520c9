"""`keras_dist.inputs.data_loader`: a torch `DataLoader`'s shards, read through real loaders.

Each shard is the loader `shard_data_loader` builds from a script's loader over a dataset
whose sample i is i, so the indices a shard reads are the batches it yields. Shards of one
call get their own `EpochPosition` with the same seed, as the processes of a job do
(`keras_dist.inputs.data_loader._share` gives a shuffling loader one). Checked over
dataset sizes 0..9 and 37, 1..4 shards, shuffle on and off, training (padded) and
evaluation (not), drop_last, three epochs, and the epoch a fit resumes inside.
"""


import pytest

torch = pytest.importorskip("torch")

from torch.utils import data  # noqa: E402

from keras_dist.inputs.position import EpochPosition  # noqa: E402
from keras_dist.inputs.data_loader import InterleavedSampler, shard_data_loader, shuffles  # noqa: E402

SIZES = [*range(10), 37]
SHARDS = [1, 2, 3, 4]
SEED = 1234
EPOCHS = 3


class Indices(data.Dataset):
    """Sample i is i."""

    def __init__(self, length):
        self.length = length

    def __len__(self):
        return self.length

    def __getitem__(self, i):
        return i


def shard_loader(length, num_shards, index, pad, shuffle=False, batch_size=2, multiplier=1, drop_last=False,
                 position=None, seed=SEED):
    """Shard `index` of a script's `DataLoader(Indices(length), ...)`, as keras_dist builds it."""
    loader = data.DataLoader(Indices(length), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last)
    if position is None and shuffles(loader):
        position = EpochPosition(seed=seed)  # as `data_loader._share`: one per call, the job's seed
    return shard_data_loader(loader, num_shards, index, pad, multiplier, position)


def read_epochs(loader, epochs=EPOCHS):
    """Each epoch's batches, as lists of sample indices, with `len(loader)` at the epoch's start."""
    out = []
    for _ in range(epochs):
        length = len(loader)
        out.append(([batch.tolist() for batch in loader], length))
    return out


def flat(batches):
    return [i for batch in batches for i in batch]


def cases(pad, shuffle=False):
    """(length, shards) of the matrix; torch has no shuffling loader of nothing (RandomSampler refuses 0 samples)."""
    return [(length, n) for length in SIZES[shuffle:] for n in SHARDS]


def shards_of_one_call(length, num_shards, pad, shuffle, **kwargs):
    """Per shard: its loader and its epochs."""
    loaders = [shard_loader(length, num_shards, i, pad, shuffle, **kwargs) for i in range(num_shards)]
    return loaders, [read_epochs(loader) for loader in loaders]


def check_batches(loader, epochs, batch_size, drop_last):
    """`len(loader)` is the batches an epoch yields (and `len(sampler)` its indices); all full but the last."""
    for batches, length in epochs:
        assert len(batches) == length
        assert all(len(batch) == batch_size for batch in batches[:-1])
        if drop_last:
            assert len(batches) == len(loader.sampler) // batch_size and all(len(b) == batch_size for b in batches)
        else:
            assert len(flat(batches)) == len(loader.sampler)


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("pad", [True, False], ids=["training", "evaluation"])
def test_shards_interleave_one_order_per_epoch(pad, shuffle):
    for length, num_shards in cases(pad, shuffle):
        loaders, shards = shards_of_one_call(length, num_shards, pad, shuffle)
        case = f"length={length} shards={num_shards}"
        orders = []
        for epoch in range(EPOCHS):
            reads = [flat(shard[epoch][0]) for shard in shards]
            for loader, shard in zip(loaders, shards):
                check_batches(loader, shard, 2, False)
            if pad:
                # Equal shards of ceil(length / N); read in turn (shard i takes i, i + N, ...) they
                # are the epoch's order, then as much of its start again as pads the last round.
                per_shard = -(-length // num_shards)
                assert [len(r) for r in reads] == [per_shard] * num_shards, case
                order = [reads[k % num_shards][k // num_shards] for k in range(per_shard * num_shards)]
                assert order[length:] == order[:len(order) - length], case
            else:
                # Shard i reads i, i + N, ... of the order and nothing more; a shard with no sample
                # of its own reads the order's first sample as a stand-in (not counted).
                own = [len(range(i, length, num_shards)) for i in range(num_shards)]
                order = [reads[k % num_shards][k // num_shards] for k in range(length)]
                for i, (r, loader) in enumerate(zip(reads, loaders)):
                    stand_in = own[i] == 0 and length > 0
                    assert loader.sampler.stand_in == stand_in, case
                    assert len(r) == (1 if stand_in else own[i]), case
                    assert r == (order[:1] if stand_in else order[i::num_shards]), case
            order = order[:length]
            assert sorted(order) == list(range(length)), case  # every sample once
            if not shuffle:
                assert order == list(range(length)), case
            orders.append(order)
        if shuffle and length >= 6:
            assert len({tuple(o) for o in orders}) == EPOCHS, f"{case}: an order repeated across epochs"
        if not shuffle:
            assert orders == [orders[0]] * EPOCHS


@pytest.mark.parametrize("length", SIZES)
def test_in_order_training_shards_are_torchs_distributed_sampler(length):
    """The module's claim: samples split as `DistributedSampler` splits, padded as it pads."""
    for num_shards in SHARDS:
        for index in range(num_shards):
            loader = shard_loader(length, num_shards, index, pad=True)
            reference = data.DistributedSampler(Indices(length), num_shards, index, shuffle=False)
            assert list(loader.sampler) == list(reference), (length, num_shards, index)
            assert len(loader.sampler) == len(reference)


@pytest.mark.parametrize("length, num_shards", [(1, 3), (1, 4), (2, 5)])
def test_training_shards_are_never_empty_with_fewer_samples_than_shards(length, num_shards):
    for index in range(num_shards):
        loader = shard_loader(length, num_shards, index, pad=True)
        reference = data.DistributedSampler(Indices(length), num_shards, index, shuffle=False)
        assert list(loader.sampler) == list(reference), index
        assert len(list(loader)) == len(loader), index


@pytest.mark.parametrize("pad", [True, False], ids=["training", "evaluation"])
@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
def test_drop_last_drops_each_shards_last_partial_batch(pad, shuffle):
    for length, num_shards in cases(pad, shuffle):
        kept = shards_of_one_call(length, num_shards, pad, shuffle, batch_size=3)[1]
        loaders, dropped = shards_of_one_call(length, num_shards, pad, shuffle, batch_size=3, drop_last=True)
        for loader, whole, shard in zip(loaders, kept, dropped):
            check_batches(loader, shard, 3, True)
            for (full, _), (batches, _) in zip(whole, shard):
                assert batches == full[:len(batches)], (length, num_shards)
        if pad:  # equal shards: equal steps
            assert len({len(loader) for loader in loaders}) == 1


@pytest.mark.parametrize("multiplier", [1, 3])
def test_a_shard_batches_the_scripts_batch_size_times_the_replicas_it_feeds(multiplier):
    loader = shard_loader(37, 2, 1, pad=True, batch_size=4, multiplier=multiplier)
    assert loader.batch_size == 4 * multiplier
    batches = read_epochs(loader, 1)[0][0]
    assert [len(b) for b in batches[:-1]] == [4 * multiplier] * (len(batches) - 1)
    assert flat(batches) == list(range(1, 37, 2)) + [0]  # 19 = ceil(37 / 2): the pad wraps to sample 0


def test_shuffled_orders_depend_on_the_seed_and_epoch_only():
    def orders(seed):
        loader = shard_loader(37, 1, 0, pad=True, shuffle=True, seed=seed)
        return [flat(batches) for batches, _ in read_epochs(loader)]

    first = orders(SEED)
    assert orders(SEED) == first  # deterministic, whatever ran before
    assert orders(SEED + 1) != first
    # Epoch e's order is the e-th iteration's on every process, however many shards read it.
    for num_shards in (2, 3):
        shards = shards_of_one_call(37, num_shards, True, True)[1]
        for epoch in range(EPOCHS):
            reads = [flat(shard[epoch][0]) for shard in shards]
            assert [reads[k % num_shards][k // num_shards] for k in range(37)] == first[epoch]


@pytest.mark.parametrize("shuffle", [False, True], ids=["in_order", "shuffled"])
@pytest.mark.parametrize("num_shards", [1, 3])
def test_the_epoch_resumed_starts_at_its_next_step_and_later_ones_whole(num_shards, shuffle):
    """A fit resumed inside epoch 1 after `skip` steps: that epoch's loader yields the
    uninterrupted run's batches from step `skip` on, while `len()` stays the epoch's
    steps (Keras's loop counts the skipped steps without reading them); epoch 2 is whole."""
    kwargs = dict(pad=True, shuffle=shuffle, batch_size=2, multiplier=2)
    for index in range(num_shards):
        uninterrupted = read_epochs(shard_loader(37, num_shards, index, **kwargs))
        steps = uninterrupted[1][1]
        for skip in range(steps + 1):
            # The samples done: each step takes the batch of 2 of 2 replicas on every shard.
            position = EpochPosition(seed=SEED, resume_epoch=1, skip=skip, skip_samples=skip * 4 * num_shards)
            resumed = read_epochs(shard_loader(37, num_shards, index, position=position, **kwargs), 2)
            assert resumed[0] == (uninterrupted[1][0][skip:], steps), (index, skip)
            assert resumed[1] == uninterrupted[2], (index, skip)


def test_the_sampler_alone_matches_its_len():
    """`InterleavedSampler` without a position (an unshuffled loader, no resume): `len()` is what it yields."""
    for pad in (True, False):
        for length, num_shards in cases(pad):
            for index in range(num_shards):
                sampler = InterleavedSampler(length, num_shards, index, pad)
                assert len(list(sampler)) == len(sampler) == len(list(sampler)), (pad, length, num_shards, index)
