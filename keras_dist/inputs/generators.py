"""Python generators: each process keeps every N-th batch of the whole stream.

A generator has no length and no index, so every process runs all of it (as the same
script, it yields the same batches everywhere) and keeps batch i where i mod N is its
shard: N replicas at batch B then take, at step k, the rows one process takes from a
generator of batches N*B. The stream is read in rounds of N batches, so each process
knows, without a collective, whether the round it is in gave it a batch:

* training (`pad`): a short last round gives the shards it missed a batch of the first
  round again, so every process runs the same number of steps;
* evaluation: a shard past the end of the first round has nothing of its own, and one
  batch stands in for it (`stand_in`; its metric states are not counted);
* prediction is padded as training is, and `reassemble` puts the gathered outputs back
  in the stream's order, padding dropped.
"""

import dataclasses
import itertools
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
from keras import tree

from keras_dist.errors import KerasDistError
from keras_dist.inputs.arrays import allgather_parts, num_samples
from keras_dist.inputs.base import InputKind, Inputs

if TYPE_CHECKING:
    from keras_dist.inputs.position import EpochPosition
    from keras_dist.replicas import Replicas


class GeneratorKind(InputKind):
    """A Python generator: every N-th batch of the stream."""

    def split(self, replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
        """This process's batches of the stream (`GeneratorShare`); for `predict` padded too."""
        plan = replicas.input_plan
        if plan.num_shards > 1:
            if plan.collective_steps or plan.batch_multiplier > 1:
                raise KerasDistError(f"backend {replicas.name!r} cannot split a Python generator (each process "
                                     "would feed several replicas or steps are collectives); pass NumPy arrays, "
                                     "a tf.data.Dataset or a keras.utils.PyDataset")
            share = GeneratorShare(data.x, plan.num_shards, plan.shard_index, pad or purpose == "predict")
            data = dataclasses.replace(data, x=share.batches(), stand_in=share.stand_in,
                                       generator_share=share if purpose == "predict" else None)
        return data

    def ordered(self, replicas: "Replicas", data: Inputs, position: "EpochPosition", shuffle: bool | str) -> None:
        """None: a generator's order is the stream's, read from its start in each process."""
        return None

    def gather(self, replicas: "Replicas", data: Inputs, outputs: Any) -> Any:
        """Predictions back in the stream's order, padding dropped (`reassemble`)."""
        sizes = data.generator_share.batch_sizes
        return tree.map_structure(lambda leaf: reassemble(allgather_parts(replicas, leaf), sizes), outputs)


class GeneratorShare:
    """One process's share of a generator of batches.

    Args:
        generator: the script's generator, yielding `x`, `(x, y)` or `(x, y, sample_weight)`.
        num_shards: the number of shards (processes that read).
        index: this process's shard.
        pad: give every shard the same number of batches (training, prediction).
    """

    def __init__(self, generator: Iterator, num_shards: int, index: int, pad: bool) -> None:
        self.source, self.num_shards, self.index, self.pad = generator, num_shards, index, pad
        # Read ahead one round: whether this shard has a batch at all is known before Keras starts.
        self.first_round = list(itertools.islice(generator, num_shards))
        self.stand_in = not pad and len(self.first_round) <= index and bool(self.first_round)
        self.batch_sizes: list[int] = []  # rows of every batch of the stream, in order

    def batches(self) -> Iterator[Any]:
        """The generator Keras reads."""
        if self.stand_in:
            yield self.first_round[0]
            return
        current = self.first_round
        while current:
            self.batch_sizes += [_rows(batch) for batch in current]
            if len(current) > self.index:
                yield current[self.index]
            elif self.pad:
                yield self.first_round[self.index % len(self.first_round)]
            if len(current) < self.num_shards:
                return
            current = list(itertools.islice(self.source, self.num_shards))


def reassemble(per_shard: list[np.ndarray], batch_sizes: list[int]) -> np.ndarray:
    """One output leaf in the stream's order, from each shard's outputs (its batches in order,
    padding last): global batch i is the next `batch_sizes[i]` rows of shard i mod N."""
    num_shards, taken, rows = len(per_shard), [0] * len(per_shard), []
    for i, size in enumerate(batch_sizes):
        shard = i % num_shards
        rows.append(per_shard[shard][taken[shard]:taken[shard] + size])
        taken[shard] += size
    return np.concatenate(rows) if rows else per_shard[0][:0]


def _rows(batch: Any) -> int:
    return num_samples(batch[0] if isinstance(batch, tuple) else batch)
