"""Backend registry and factory: one string name per backend, one module per backend.

Selection order (first match wins), documented in the README:
  1. `keras_dist.init(backend=...)`, then the `KERAS_DIST_BACKEND` environment variable;
  2. the launcher that started the process, in `REGISTRY` order (`detect`);
  3. `single`, a plain process.
"""

import importlib
import inspect
import json
import os
import sys

from keras_dist.errors import KerasDistError

# name -> (the Keras backend it trains on, "module:Class"); None: any. Order is detection
# order. Adding a backend adds one line here. Detection skips entries for another Keras
# backend without importing them, so Keras on JAX never imports TensorFlow.
REGISTRY = {
    "jax": ("jax", "keras_dist.backends.jax_data_parallel:JaxDataParallelBackend"),
    "torch": ("torch", "keras_dist.backends.torch_distributed:TorchDistributedBackend"),
    "horovod": ("tensorflow", "keras_dist.backends.horovod:HorovodBackend"),
    "parameter_server": ("tensorflow", "keras_dist.backends.parameter_server:ParameterServerBackend"),
    "multi_worker_mirrored": ("tensorflow", "keras_dist.backends.multi_worker_mirrored:MultiWorkerMirroredBackend"),
    "tpu": ("tensorflow", "keras_dist.backends.tpu:TPUBackend"),
    "mirrored": ("tensorflow", "keras_dist.backends.mirrored:MirroredBackend"),
    "central_storage": ("tensorflow", "keras_dist.backends.central_storage:CentralStorageBackend"),
    "one_device": ("tensorflow", "keras_dist.backends.one_device:OneDeviceBackend"),
    "single": (None, "keras_dist.backends.single:SingleBackend"),
}

ENV_VAR = "KERAS_DIST_BACKEND"


def keras_backend(environ):
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


def backend_class(name):
    """The class registered under `name`; a one-line error lists the valid names."""
    if name not in REGISTRY:
        raise KerasDistError(
            f"unknown keras_dist backend {name!r}; choose one of: {', '.join(REGISTRY)}"
        )
    module, cls = REGISTRY[name][1].split(":")
    return getattr(importlib.import_module(module), cls)


def select(requested=None, environ=None):
    """Returns `(name, reason)` for the backend this process should use."""
    environ = os.environ if environ is None else environ
    running = keras_backend(environ)
    if requested or environ.get(ENV_VAR):
        name = requested or environ[ENV_VAR]
        trains_on = REGISTRY.get(name, (None,))[0]
        if trains_on not in (None, running):
            raise KerasDistError(f"backend {name!r} trains Keras on {trains_on}, but Keras runs on {running}; "
                                 f"set KERAS_BACKEND={trains_on} or choose another backend")
        return name, "requested by keras_dist.init(backend=...)" if requested else f"set by {ENV_VAR}"
    for name, (trains_on, _) in REGISTRY.items():
        if name != "single" and trains_on in (None, running) and backend_class(name).detect(environ):
            return name, f"detected the {name} launcher's environment"
    return "single", "no launcher detected"


def create(name, **options):
    """A started backend; `options` go to its constructor (e.g. `tpu=` for `tpu`)."""
    cls = backend_class(name)
    unknown = set(options) - set(inspect.signature(cls.__init__).parameters)
    if unknown:
        raise KerasDistError(f"backend {name!r} takes no option {', '.join(sorted(unknown))}; remove it from keras_dist.init")
    return cls(**options)
