"""This process's runtime: every fact keras_dist derives about the process, derived once.

The `Runtime` holds the settings (`keras_dist.settings`), the cluster environment the
launcher set (`keras_dist.environments`), the backend chosen with the reason, the address
of the network interface the job's traffic takes, and the strategy once started. It is
built on first use, from the process's environment (`import keras_dist` builds it in a
process a launcher started); `startup`, `keras_dist.compile` and `keras-dist info` read
it, and the strategy is made with its cluster environment and settings
(`strategies.create`): strategies, their collectives and fault tolerance take their facts
from those and never read the process environment. Tests
build their own with `Runtime.from_environ(mapping)`.
"""

import contextlib
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from keras_dist import console, environments, settings, strategies
from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    import tensorflow as tf

    from keras_dist.strategies.base import Strategy


@dataclasses.dataclass
class Runtime:
    """What keras_dist knows of this process.

    Args:
        settings: keras_dist's settings, read once.
        environment: this process's place in its job, as the chosen strategy reads it.
        backend: the keras_dist backend (strategy) chosen.
        reason: why that backend (requested, set by KERAS_DIST_BACKEND, detected...).
        strategy: the started strategy (None until `init`).
    """

    settings: settings.Settings
    environment: environments.ClusterEnvironment
    backend: str
    reason: str
    strategy: "Strategy | None" = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], backend: str | None = None,
                     chosen: settings.Settings | None = None) -> "Runtime":
        """The runtime of a process whose environment is `environ`; `backend` as `init`'s."""
        chosen = chosen or settings.Settings.from_environ(environ)
        detected = environments.detect(environ)
        name, reason = strategies.select(backend, environ, chosen, detected)
        environment = strategies.strategy_class(name).process_setup.cluster_environment(environ, detected)
        return cls(chosen, environment, name, reason)

    def describe(self) -> dict:
        return {**self.environment.describe(), "backend": self.backend, "why": self.reason}


_runtime: Runtime | None = None


def get() -> Runtime:
    """This process's runtime, built on first use."""
    global _runtime
    if _runtime is None:
        chosen = settings.current()
        _runtime = Runtime.from_environ(chosen.variables, chosen=chosen)
    return _runtime


def init(backend: str | None = None, **options: Any) -> "Strategy":
    """Starts keras_dist in this process and returns the active strategy.

    Calling it is optional: `keras_dist.compile` calls it. Call it yourself to pick a
    backend explicitly or to read the topology before building the model.

    Args:
        backend: a backend name (see `keras_dist.strategies.REGISTRY`); default: the
            `KERAS_DIST_BACKEND` environment variable, else the launcher detected.
        **options: backend options, e.g. `tpu="my-tpu"` for the `tpu` backend.

    Returns:
        The strategy, with `name`, `rank`, `size`, `local_rank`, `is_chief` and
        `num_replicas`.

    Example:

    ```python
    ctx = keras_dist.init()
    print(ctx.name, ctx.rank, ctx.size, ctx.is_chief)
    ```
    """
    global _runtime
    runtime = get()
    if backend:
        strategies.strategy_class(backend)  # a bad name stops here, in one line
    if runtime.strategy is not None:
        if backend and backend != runtime.strategy.name:
            raise KerasDistError(
                f"keras_dist already runs the {runtime.strategy.name!r} backend; call "
                f"keras_dist.init(backend={backend!r}) before anything else uses keras_dist"
            )
        return runtime.strategy
    if backend and backend != runtime.backend:
        # The script chose another backend than the launcher's: its strategy reads the environment its own way.
        chosen = Runtime.from_environ(runtime.settings.variables, backend, runtime.settings)
        environment = dataclasses.replace(chosen.environment, job_address=runtime.environment.job_address)
        runtime = _runtime = dataclasses.replace(chosen, environment=environment)
    runtime.strategy = strategies.create(runtime.backend, runtime.environment, runtime.settings, **options)
    console.announce(runtime.strategy)
    # They import Keras, which `keras-dist` itself never does.
    from keras_dist import compiled_elsewhere
    from keras_dist.fault_tolerance import tf_checkpoints

    compiled_elsewhere.watch(runtime.strategy)
    tf_checkpoints.watch(runtime.strategy)
    return runtime.strategy


def current() -> "Strategy":
    """The active strategy, starting the default one if `init` was not called."""
    strategy = get().strategy
    return strategy if strategy is not None else init()


def split_weights() -> contextlib.AbstractContextManager[None]:
    """Context in which to build a model whose trainable weights are split over the job's
    processes from their creation (PyTorch and JAX; on TensorFlow, and without a launcher,
    the model is built as usual): no process holds it whole outside a step. `keras_dist.compile` then trains
    it with `shard="weights"` (docs/sharding.md).

    Example:

    ```python
    with keras_dist.split_weights():
        model = keras.Sequential([keras.Input((4096,)), keras.layers.Dense(4096), ...])
    keras_dist.compile(model, optimizer="adam", loss="mse")
    ```
    """
    return current().creating_split_weights()


def distribute_dataset(dataset: "tf.data.Dataset", training: bool = True) -> "tf.data.Dataset":
    """This process's share of `dataset`, as keras_dist's `fit` (or `evaluate`) reads it.

    For loops of your own, and to see what each worker reads: a batched dataset whose
    batch size is per replica, split as described in `keras_dist.inputs`.

    Args:
        dataset: a batched `tf.data.Dataset`, the same on every process.
        training: pad the shards to equal length, as `fit` does (collective; every
            process must call it).

    Example:

    ```python
    for x, y in keras_dist.distribute_dataset(dataset):
        ...
    ```
    """
    from keras_dist import inputs

    return inputs.dataset_share(current(), dataset, training)
