"""`tf.distribute.OneDeviceStrategy`: one process, one replica, on a device of your choice."""

from typing import TYPE_CHECKING

from keras_dist.strategies.tf_strategy import TFDistributeStrategy
from keras_dist.errors import KerasDistError
from keras_dist.settings import Settings
from keras_dist.environments import ClusterEnvironment

if TYPE_CHECKING:
    import tensorflow as tf



class OneDeviceStrategy(TFDistributeStrategy):
    """Everything (variables and compute) on one device: the first GPU, else the CPU.

    Trains as the `single` backend does, but pins the model to the device, so a script
    can switch to a multi-replica strategy later without other changes. Never detected:
    select it with `KERAS_DIST_BACKEND=one_device` or `keras_dist.init(backend="one_device")`.

    Args:
        device: a TensorFlow device name such as `"/gpu:1"` or `"/cpu:0"`; default:
            the first GPU, else the CPU.

    Example:

    ```python
    keras_dist.init(backend="one_device", device="/gpu:1")
    keras_dist.compile(model, optimizer="adam", loss="mse")
    ```
    """

    name = "one_device"

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None, device: str | None = None):
        self.requested_device = device  # keras_dist.init(backend="one_device", device=...)
        super().__init__(environment, chosen)

    def make_strategy(self) -> "tf.distribute.Strategy":
        import tensorflow as tf

        local = [d.name for d in tf.config.list_logical_devices()]
        if self.requested_device is None:
            gpus = [d.name for d in tf.config.list_logical_devices("GPU")]
            return tf.distribute.OneDeviceStrategy(gpus[0] if gpus else "/cpu:0")
        if not _is_local_device(self.requested_device, local):
            raise KerasDistError(
                f"backend 'one_device' found no device {self.requested_device!r} here; pass one of "
                f"{', '.join(local)} as keras_dist.init(backend='one_device', device=...)"
            )
        return tf.distribute.OneDeviceStrategy(self.requested_device)


def _is_local_device(name, local_names):
    """Whether `name` ("/gpu:1", "GPU:0", ...) is one of `local_names` (logical device names).

    OneDeviceStrategy itself takes any name and fails, or silently falls back, only
    when the first op runs; checking up front gives the one-line error instead.
    """
    import tensorflow as tf

    try:
        wanted = tf.DeviceSpec.from_string(name)
    except ValueError:
        return False
    if wanted.device_type is None or wanted.job not in (None, "localhost"):
        return False
    for local in map(tf.DeviceSpec.from_string, local_names):
        if local.device_type == wanted.device_type.upper() and local.device_index == (wanted.device_index or 0):
            return True
    return False
