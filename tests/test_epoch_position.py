"""An epoch interrupted on N processes and resumed on M: the inputs keras_dist orders (arrays,
PyDatasets of known length, DataLoaders it splits) train each sample of it exactly once.

The pieces as `fit` builds them, read the way Keras's loop reads them: the first run reads
the epoch's first `done` steps on N shards, the rerun learns the units done from the
backup's count (`EpochPosition.step_samples`) and reads the rest on M shards. Together they
must hold every sample once, and again only the rerun's padding (fewer than M units,
from the order's start, as `DistributedSampler` pads).
"""

import keras
import numpy as np
import pytest

from keras_dist.inputs.arrays import EpochRows
from keras_dist.inputs.position import EpochPosition
from keras_dist.inputs.py_dataset import ShardedPyDataset

LENGTH, BATCH, EPOCH = 50, 2, 1


class Numbered(keras.utils.PyDataset):
    """Batch i is sample i alone."""

    def __len__(self):
        return LENGTH

    def __getitem__(self, index):
        return np.array([[index]]), np.array([index])


def arrays(num_shards, index, position):
    ids = np.arange(LENGTH)
    return EpochRows({"x": ids, "y": ids, "sample_weight": None}, num_shards, index, BATCH, position)


def py_dataset(num_shards, index, position):
    return ShardedPyDataset(Numbered(), num_shards, index, pad=True, position=position, shuffle=True)


def data_loader(num_shards, index, position):
    torch = pytest.importorskip("torch")
    from keras_dist.inputs.data_loader import shard_data_loader

    loader = torch.utils.data.DataLoader(torch.arange(LENGTH), batch_size=BATCH, shuffle=True)
    return shard_data_loader(loader, num_shards, index, True, 1, position)


def read_steps(kind, num_shards, position):
    """Each step's units over all shards, for the epoch `position` starts (Keras's loop reads
    the steps that `resizable.steps_after` counts)."""
    shards, units = [], []
    for index in range(num_shards):
        shard_position = EpochPosition(**{k: v for k, v in vars(position).items() if k not in ("resizable",)})
        shard = kind(num_shards, index, shard_position)
        steps = shard_position.resizable.steps_after(shard_position.first_sample(EPOCH))
        shard_position.epoch, shard_position.iterations = EPOCH, 0
        if kind is data_loader:
            batches = [b.tolist() for b in shard]
        else:
            batches = [np.ravel(shard[step][1]).tolist() for step in range(steps)]
        assert len(batches) == steps, (kind.__name__, num_shards, index)
        shards.append(batches)
        units.append(shard_position.step_samples)
    return [sum((s[step] for s in shards), []) for step in range(len(shards[0]))], units[0]


@pytest.mark.parametrize("kind", [arrays, py_dataset, data_loader])
@pytest.mark.parametrize("before, after", [(2, 1), (1, 3), (3, 2), (4, 3)])
def test_an_epoch_resumed_on_another_count_trains_each_sample_once(kind, before, after):
    seed = 5
    whole, step_units = read_steps(kind, before, EpochPosition(seed=seed, resume_epoch=EPOCH))
    for done in range(len(whole)):
        samples = done * step_units  # what the backup after `done` steps holds
        resumed = EpochPosition(seed=seed, resume_epoch=EPOCH, skip_samples=samples)
        rest, _ = read_steps(kind, after, resumed)
        trained = sum(whole[:done], []) + sum(rest, [])
        assert sorted(set(trained)) == list(range(LENGTH)), (kind.__name__, done)
        # The only samples trained twice: the rerun's padding, from the order's start.
        assert len(trained) - LENGTH == (-(LENGTH - samples)) % after, (kind.__name__, done)


def test_static_batches_resumed_on_another_count_stay_full_and_train_every_sample():
    """On TensorFlow arrays are read in batches of a static size where every batch of an epoch
    is full, as plain Keras's are (`EpochRows.static_batches`); an epoch resumed inside on
    another count, whose last batch would be short, takes rows from the shard's start instead."""
    ids = np.arange(48)
    first = EpochRows({"x": ids, "y": ids, "sample_weight": None}, 2, 0, 4, EpochPosition(seed=1))
    assert first.full_batches()  # 24 rows a shard
    samples = 8  # a backup after one step of 2 x 4
    trained = []
    for index in range(3):
        position = EpochPosition(seed=1, resume_epoch=0, skip_samples=samples)
        rows = EpochRows({"x": ids, "y": ids, "sample_weight": None}, 3, index, 4, position)
        rows.static_batches = True
        position.epoch = 0
        shard = rows.epoch_rows()
        assert len(shard) % 4 == 0 and len(shard) // 4 == rows.steps_after(samples), (index, len(shard))
        trained += shard.tolist()
    # Every sample left trains; the padding repeats a few (from the order's start, then the shard's).
    assert set(EpochPosition(seed=1).order(0, 48)[samples:].tolist()) <= set(trained)
