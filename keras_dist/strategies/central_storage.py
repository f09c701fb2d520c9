"""`tf.distribute.experimental.CentralStorageStrategy`: variables on the CPU, compute on every local device."""

from typing import TYPE_CHECKING

from keras_dist import keras_workarounds
from keras_dist.strategies.tf_strategy import TFDistributeStrategy, local_replica_devices

if TYPE_CHECKING:
    import tensorflow as tf


class CentralStorageStrategy(TFDistributeStrategy):
    """Synchronous data parallelism on one machine with one copy of the variables, on the CPU.

    Each step runs on every GPU (else on every logical CPU device); the replicas read
    the variables from the CPU and their gradients are summed there, which suits a few
    GPUs without peer-to-peer links. Never detected: select it with
    `KERAS_DIST_BACKEND=central_storage` or `keras_dist.init(backend="central_storage")`.
    Per-replica batch: `fit(batch_size=B)` trains at B x replicas.

    Example:

    ```python
    keras_dist.init(backend="central_storage")
    keras_dist.compile(model, optimizer="adam", loss="mse")
    ```
    """

    name = "central_storage"
    keras_workarounds = TFDistributeStrategy.keras_workarounds + (keras_workarounds.metric_increments_added_once,
                                                                  keras_workarounds.layer_state_aggregated)

    def make_strategy(self) -> "tf.distribute.Strategy":
        import tensorflow as tf

        return tf.distribute.experimental.CentralStorageStrategy(local_replica_devices(self.name), parameter_device="/cpu:0")
