"""Strategy registry and factory: one name per strategy (the *backend* a user picks), one module each.

Selection order (first match wins), documented in docs/backends.md (Selection):
  1. `keras_dist.init(backend=...)`, then the `KERAS_DIST_BACKEND` environment variable;
  2. the launcher that started the process, in `REGISTRY` order (`ProcessSetup.detect`);
  3. `single`, a plain process.
"""

import importlib
import inspect
import json
import os
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from keras_dist.errors import KerasDistError

if TYPE_CHECKING:
    from keras_dist.environments import ClusterEnvironment
    from keras_dist.launchers.base import Task
    from keras_dist.launchers.nodes import Nodes
    from keras_dist.settings import Settings
    from keras_dist.strategies.base import Strategy



class Entry(NamedTuple):
    """A registered strategy, described without importing it (nor the framework it imports)."""

    keras_backend: str | None  # the Keras backend it trains on; None: any
    path: str  # "module:Class"
    launcher: str = ""  # the `keras_dist.launchers` entry that starts a local cluster; "": none


# Order is detection order. Adding a strategy adds one line here. Detection skips entries
# for another Keras backend without importing them, so Keras on JAX never imports
# TensorFlow, and `keras-dist launch` reads launchers here, importing no strategy.
REGISTRY = {
    "jax": Entry("jax", "keras_dist.strategies.jax_data_parallel:JaxDataParallelStrategy", "keras_distribution"),
    "torch": Entry("torch", "keras_dist.strategies.torch_distributed:TorchDistributedStrategy", "torchrun"),
    "horovod": Entry("tensorflow", "keras_dist.strategies.horovod:HorovodStrategy", "horovod_gloo"),
    "parameter_server": Entry("tensorflow", "keras_dist.strategies.parameter_server.strategy:ParameterServerStrategy",
                              "tf_config_with_ps"),
    "multi_worker_mirrored": Entry("tensorflow", "keras_dist.strategies.multi_worker_mirrored:MultiWorkerMirroredStrategy",
                                   "tf_config"),
    "tpu": Entry("tensorflow", "keras_dist.strategies.tpu:TPUStrategy"),
    "mirrored": Entry("tensorflow", "keras_dist.strategies.mirrored:MirroredStrategy"),
    "central_storage": Entry("tensorflow", "keras_dist.strategies.central_storage:CentralStorageStrategy"),
    "one_device": Entry("tensorflow", "keras_dist.strategies.one_device:OneDeviceStrategy"),
    "single": Entry(None, "keras_dist.strategies.single:SingleProcessStrategy"),
}

BACKEND_VARIABLE = "KERAS_DIST_BACKEND"


def keras_backend(environ: Mapping[str, str]) -> str:
    """The Keras backend this process runs or will run, read as Keras reads it.

    Without importing Keras: under TensorFlow that would start TensorFlow before a
    strategy that must be configured first (MultiWorkerMirrored).
    """
    if "keras" in sys.modules:
        return sys.modules["keras"].backend.backend()
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get("KERAS_HOME") or os.path.join(os.path.expanduser("~"), ".keras")
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return json.load(f).get("backend", "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


def strategy_class(name: str) -> type["Strategy"]:
    """The class registered under `name`; a one-line error lists the valid names."""
    if name not in REGISTRY:
        raise KerasDistError(
            f"unknown keras_dist backend {name!r}; choose one of: {', '.join(REGISTRY)}"
        )
    module, cls = REGISTRY[name].path.split(":")
    return getattr(importlib.import_module(module), cls)


def select(requested: str | None, environ: Mapping[str, str], chosen: "Settings",
           detected: "ClusterEnvironment") -> tuple[str, str]:
    """Returns `(name, reason)` for the backend this process should use.

    Args:
        requested: the name given to `keras_dist.init(backend=...)`, if any.
        environ: what the launcher set (the Keras backend is read as Keras reads it).
        chosen: keras_dist's settings (`KERAS_DIST_BACKEND`).
        detected: the cluster environment the launcher set (`environments.detect`).
    """
    running = keras_backend(environ)
    if requested or chosen.backend:
        name = requested or chosen.backend
        trains_on = REGISTRY[name].keras_backend if name in REGISTRY else None
        if trains_on not in (None, running):
            raise KerasDistError(f"backend {name!r} trains Keras on {trains_on}, but Keras runs on {running}; "
                                 f"set KERAS_BACKEND={trains_on} or choose another backend")
        return name, "requested by keras_dist.init(backend=...)" if requested else f"set by {BACKEND_VARIABLE}"
    for name, (trains_on, _, _) in REGISTRY.items():
        if name != "single" and trains_on in (None, running) and strategy_class(name).process_setup.detect(environ, detected):
            return name, f"detected the {name} launcher's environment"
    return "single", "no launcher detected"


def create(name: str, environment: "ClusterEnvironment", chosen: "Settings", **options: Any) -> "Strategy":
    """Backend `name`, started in `environment` (its `cluster_environment`) with keras_dist's
    settings `chosen` (and the variables they were read from); `options` go to its
    constructor (e.g. `tpu=` for `tpu`)."""
    cls = strategy_class(name)
    unknown = set(options) - (set(inspect.signature(cls.__init__).parameters) - {"environment", "chosen"})
    if unknown:
        raise KerasDistError(f"backend {name!r} takes no option {', '.join(sorted(unknown))}; remove it from keras_dist.init")
    return cls(environment, chosen, **options)


def launcher_of(name: str) -> str:
    """The `keras_dist.launchers` entry that starts a local cluster for strategy `name` ("": none)."""
    if name not in REGISTRY:
        strategy_class(name)  # its one-line error lists the valid names
    return REGISTRY[name].launcher


def local_cluster(name: str, num_workers: int, num_ps: int, argv: list[str],
                  nodes: "Nodes | None" = None) -> list["Task"]:
    """The tasks (`keras_dist.launchers.Task`) that run `argv` under strategy `name` on this machine.

    `nodes` (`keras_dist.launchers.nodes.Nodes`) places this machine in a job of several.

    Its launcher describes them; each task is also told the Keras backend the strategy
    trains on, so `--backend jax` works without exporting KERAS_BACKEND.
    """
    from keras_dist import launchers

    launcher = launcher_of(name)
    if not launcher:
        raise KerasDistError(f"backend {name!r} has no local launcher; run the script directly")
    tasks = launchers.create(launcher).tasks(num_workers, num_ps, argv, nodes)
    trains_on = REGISTRY[name].keras_backend
    for task in tasks:
        if trains_on:
            task.env["KERAS_BACKEND"] = trains_on
    return tasks
