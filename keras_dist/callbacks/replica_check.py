"""Replicas never diverge silently: after each epoch, every worker's weights are compared."""

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas


class ReplicaCheck(keras.callbacks.Callback):
    """Ends the epoch with every worker holding the same model, or stops with the cause.

    keras_dist runs it first at each epoch end, before the user's callbacks save or log
    anything. Float non-trainable weights (BatchNormalization's moving statistics,
    updated from each worker's own batches) are first averaged over workers. Then a
    digest of every worker's trainable weights is compared: one small allgather per epoch.
    A mismatch means some update was not reduced across workers.

    Args:
        replicas: the job as this process sees it (`Replicas`), of more than one process.
    """

    def __init__(self, replicas: "Replicas") -> None:
        super().__init__()
        self.replicas = replicas

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        average_statistics(self.model, self.replicas)
        digests = self.replicas.collectives.allgather_object(weights_digest(self.replicas.checkpoint_io.replicated_weights(
            self.model.trainable_weights)))
        differing = [rank for rank, digest in enumerate(digests) if digest != digests[0]]
        if differing:
            raise KerasDistError(
                f"after epoch {epoch + 1} the trainable weights of worker(s) {differing} differ from the chief's: "
                "an update was not reduced across workers; give every optimizer the model uses to "
                "keras_dist.compile (as compile arguments or model attributes) and change weights only through them"
            )


def weights_digest(weights: Iterable[keras.Variable]) -> bytes:
    """A BLAKE2 digest of the weights' bytes, in order: equal only for bit-identical replicas
    (where equal, the chief's state is not sent again at fit's start)."""
    digest = hashlib.blake2b(digest_size=16)
    for weight in weights:
        digest.update(np.ascontiguousarray(keras.ops.convert_to_numpy(weight)).tobytes())
    return digest.digest()


def average_statistics(model: keras.Model, replicas: "Replicas") -> None:
    """Sets every float non-trainable weight of `model` to its mean over processes."""
    # Weights split over the processes (a frozen layer of a model built split) are one copy already.
    statistics = [w for w in replicas.checkpoint_io.replicated_weights(model.non_trainable_weights)
                  if "float" in str(w.dtype)]
    if not statistics:
        return
    sums = replicas.collectives.sum_arrays([keras.ops.convert_to_numpy(w) for w in statistics])
    for weight, total in zip(statistics, sums):
        weight.assign(total / replicas.size)
