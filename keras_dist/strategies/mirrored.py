"""`tf.distribute.MirroredStrategy`: one process, one replica per local GPU (or CPU device)."""


from collections.abc import Mapping
from typing import TYPE_CHECKING

from keras_dist.environments import ClusterEnvironment
from keras_dist.keras_workarounds import with_undivided_losses
from keras_dist.strategies.base import ProcessSetup
from keras_dist.strategies.tf_strategy import TFDistributeStrategy, local_replica_devices

if TYPE_CHECKING:
    import tensorflow as tf


def _visible_gpu_count(environ):
    """GPUs named by CUDA_VISIBLE_DEVICES, or None when it is unset (we do not probe)."""
    value = environ.get("CUDA_VISIBLE_DEVICES")
    if value is None:
        return None
    return len([d for d in value.split(",") if d.strip() and d.strip() != "-1"])


class MirroredSetup(ProcessSetup):
    """What backend 'mirrored' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        return (_visible_gpu_count(environ) or 0) > 1 and "TF_CONFIG" not in environ


class MirroredStrategy(TFDistributeStrategy):
    """Synchronous data parallelism over the devices of one machine.

    Selected when `CUDA_VISIBLE_DEVICES` names more than one GPU (detection only reads
    the environment), or with `KERAS_DIST_BACKEND=mirrored`. Uses every GPU, else every
    logical CPU device (`tf.config.set_logical_device_configuration`), so it can be
    tried on a laptop. Per-replica batch: `fit(batch_size=B)` trains at B x replicas.
    """

    name = "mirrored"
    process_setup = MirroredSetup

    def make_strategy(self) -> "tf.distribute.Strategy":
        import tensorflow as tf

        return with_undivided_losses(tf.distribute.MirroredStrategy)(local_replica_devices(self.name))
