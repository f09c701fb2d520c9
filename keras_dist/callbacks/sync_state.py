"""Start every replica from the chief's weights, optimizer state and epoch."""

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING

import keras

from keras_dist import keras_internals, optimizer_hooks, optimizer_sharding
from keras_dist.callbacks.replica_check import weights_digest
from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

logger = logging.getLogger("keras_dist")


class SyncInitialState(keras.callbacks.Callback):
    """Broadcasts the chief's model and optimizer state before the first update.

    keras_dist places it after the user's callbacks, so weights the chief restored in
    `on_train_begin` (`BackupAndRestore`) reach every worker, with the epoch to resume
    from. Before broadcasting it checks that every process built the same model, which
    would otherwise hang the first collective.

    Args:
        replicas: the job as this process sees it (`Replicas`).
    """

    def __init__(self, replicas: "Replicas") -> None:
        super().__init__()
        self.replicas = replicas

    def on_train_begin(self, logs: dict | None = None) -> None:
        sync_model_state(self.model, self.replicas)
        # BackupAndRestore (chief only) sets the epoch to resume from.
        chiefs = self.replicas.collectives.broadcast_object(keras_internals.initial_epoch(self.model))
        keras_internals.set_initial_epoch(self.model, chiefs)


def sync_model_state(model: keras.Model, replicas: "Replicas") -> None:
    """Checks the models match across processes, then copies the chief's state to all.

    With the job's shared seed (`keras_dist.startup`) the weights already agree, so the
    copy only carries what the chief alone holds (a restored checkpoint); where it
    changes a worker's weights, the log says so.
    """
    optimizer = model.optimizer
    if optimizer is not None and not optimizer.built and model.built:  # an unbuilt model: fit builds both
        with replicas.scope():  # before any fit (evaluate first), nothing else opened it
            optimizer.build(model.trainable_variables)
    # Optimizers a custom `compile` holds build on their first update, from zeros on every
    # process; a sharded optimizer's state is each process's own share.
    built = [o for o in optimizer_hooks.optimizers_of(model) if o.built]
    sharded = [o for o in built if optimizer_sharding.is_sharded(o)]
    optimizer_variables = [v for o in built if o not in sharded for v in o.variables]
    # Weights split for good (`keras_dist.split_weights`) have one copy in the job: their slices.
    replicated = replicas.checkpoint_io.replicated_weights(model.weights)
    variables = replicated + optimizer_variables
    check_same_variables(variables, replicas)
    digests = replicas.collectives.allgather_object((weights_digest(replicated), weights_digest(optimizer_variables)))
    differing = [rank for rank, digest in enumerate(digests) if digest[0] != digests[0][0]]
    if differing:
        logger.info("the weights of rank(s) %s differed from the chief's before training; all now start from the "
                    "chief's (a checkpoint it restored, or weights made per process)", differing)
    # Where every process holds the chief's state already (the job's shared seed), nothing is
    # sent: a broadcast of the whole model and optimizer state doubled a JAX process's peak memory.
    if any(digest != digests[0] for digest in digests):
        replicas.collectives.broadcast_variables(variables)
    for optimizer in sharded:
        optimizer_sharding.share_loaded_state(optimizer, replicas)
    replicas.after_initial_sync(model)


def check_same_variables(variables: Iterable[keras.Variable], replicas: "Replicas") -> None:
    """Stops with a one-line error unless every process has variables of these paths and shapes.

    A collective over variables that differ would hang or fail deep inside TensorFlow.
    """
    signature = [(v.path, tuple(v.shape), str(v.dtype)) for v in variables]
    signatures = replicas.collectives.allgather_object(signature)
    for rank, other in enumerate(signatures):
        if other != signatures[0]:
            raise KerasDistError(
                f"the model on rank {rank} differs from rank 0's ({_first_difference(signatures[0], other)}); "
                "build the same model, with the same layers and shapes, on every process"
            )


def _first_difference(reference, other):
    if len(reference) != len(other):
        return f"{len(other)} variables instead of {len(reference)}"
    for mine, theirs in zip(reference, other):
        if mine != theirs:
            return f"{theirs[0]} has shape {theirs[1]}, rank 0 has {mine[0]} with shape {mine[1]}"
    return "unknown difference"
