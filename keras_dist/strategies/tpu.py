"""`tf.distribute.TPUStrategy`: the cores of a Cloud TPU (TPU VM or TPU node)."""

import glob
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from keras_dist import keras_workarounds
from keras_dist.strategies.base import ProcessSetup
from keras_dist.strategies.tf_strategy import TFDistributeStrategy
from keras_dist.environments import ClusterEnvironment
from keras_dist.errors import KerasDistError, first_line
from keras_dist.settings import Settings

if TYPE_CHECKING:
    import tensorflow as tf


# Steps run per host call unless the script sets `steps_per_execution` itself: a TPU
# step is short, and a host round trip per step would leave the TPU idle.
DEFAULT_STEPS_PER_EXECUTION = 32


def tpu_address(environ: Mapping[str, str], requested: str | None = None,
                device_globs: Sequence[str] = ("/dev/accel*", "/dev/vfio/[0-9]*")) -> str | None:
    """The `tpu` argument for `TPUClusterResolver`, or None when no TPU is in sight.

    Args:
        environ: the environment to read.
        requested: a TPU name or address given by the user (wins over the environment).
        device_globs: paths whose presence marks a TPU VM (the TPU is local).

    Example:

    ```python
    tpu_address(chosen.variables)  # "my-tpu", "local" on a TPU VM, or None
    ```
    """
    if requested:
        return requested
    for variable in ("TPU_NAME", "KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS"):
        if environ.get(variable):
            return environ[variable]
    if any(glob.glob(pattern) for pattern in device_globs):
        return "local"
    return None


class TPUSetup(ProcessSetup):
    """What backend 'tpu' needs of its process before a strategy exists."""

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        return bool(environ.get("TPU_NAME") or environ.get("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS"))


class TPUStrategy(TFDistributeStrategy):
    """Synchronous data parallelism over TPU cores.

    Selected when TPU_NAME or KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS is set (a TPU VM is used
    with `KERAS_DIST_BACKEND=tpu`, or `keras_dist.init(backend="tpu")`). Name a TPU
    explicitly with `keras_dist.init(backend="tpu", tpu=NAME)` or `KERAS_DIST_TPU`. `steps_per_execution` defaults to
    `DEFAULT_STEPS_PER_EXECUTION` when the script does not set it.
    """

    name = "tpu"
    process_setup = TPUSetup
    compile_defaults = {"steps_per_execution": DEFAULT_STEPS_PER_EXECUTION}
    # TPUStrategy runs Keras's own step functions (keras_workarounds.step_functions is for the others).
    keras_workarounds = (keras_workarounds.build_from_local_batch,)

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None, tpu: str | None = None):
        self.requested_tpu = tpu  # keras_dist.init(backend="tpu", tpu=...)
        super().__init__(environment, chosen)

    def make_strategy(self) -> "tf.distribute.Strategy":
        import tensorflow as tf

        address = tpu_address(self.settings.variables, self.requested_tpu or self.settings.tpu)
        if address is None:
            raise KerasDistError(
                "backend 'tpu' found no TPU: set TPU_NAME (or KERAS_DIST_TPU) to your TPU's name, "
                "or run on a TPU VM"
            )
        try:
            resolver = tf.distribute.cluster_resolver.TPUClusterResolver(tpu=address)
            tf.config.experimental_connect_to_cluster(resolver)
            tf.tpu.experimental.initialize_tpu_system(resolver)
        except Exception as exc:  # resolver and runtime raise many types; say which TPU
            raise KerasDistError(
                f"backend 'tpu' could not reach TPU {address!r} ({first_line(exc)}); check TPU_NAME "
                "and that this machine may use that TPU"
            ) from None
        return tf.distribute.TPUStrategy(resolver)
