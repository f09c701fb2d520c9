"""Backend registry and factory: one string name per backend, one module per backend.

Selection order (first match wins), documented in the README:
  1. `keras_dist.init(backend=...)`, then the `KERAS_DIST_BACKEND` environment variable;
  2. the launcher that started the process, in `REGISTRY` order (`detect`);
  3. `single`, a plain process.
"""

import importlib
import inspect
import os

from keras_dist.errors import KerasDistError

# name -> "module:Class". Order is detection order. Adding a backend adds one line here.
REGISTRY = {
    "horovod": "keras_dist.backends.horovod:HorovodBackend",
    "parameter_server": "keras_dist.backends.parameter_server:ParameterServerBackend",
    "multi_worker_mirrored": "keras_dist.backends.multi_worker_mirrored:MultiWorkerMirroredBackend",
    "tpu": "keras_dist.backends.tpu:TPUBackend",
    "mirrored": "keras_dist.backends.mirrored:MirroredBackend",
    "central_storage": "keras_dist.backends.central_storage:CentralStorageBackend",
    "one_device": "keras_dist.backends.one_device:OneDeviceBackend",
    "single": "keras_dist.backends.single:SingleBackend",
}

ENV_VAR = "KERAS_DIST_BACKEND"


def backend_class(name):
    """The class registered under `name`; a one-line error lists the valid names."""
    if name not in REGISTRY:
        raise KerasDistError(
            f"unknown keras_dist backend {name!r}; choose one of: {', '.join(REGISTRY)}"
        )
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def select(requested=None, environ=None):
    """Returns `(name, reason)` for the backend this process should use."""
    environ = os.environ if environ is None else environ
    if requested:
        return requested, "requested by keras_dist.init(backend=...)"
    if environ.get(ENV_VAR):
        return environ[ENV_VAR], f"set by {ENV_VAR}"
    for name in REGISTRY:
        if name != "single" and backend_class(name).detect(environ):
            return name, f"detected the {name} launcher's environment"
    return "single", "no launcher detected"


def create(name, **options):
    """A started backend; `options` go to its constructor (e.g. `tpu=` for `tpu`)."""
    cls = backend_class(name)
    unknown = set(options) - set(inspect.signature(cls.__init__).parameters)
    if unknown:
        raise KerasDistError(f"backend {name!r} takes no option {', '.join(sorted(unknown))}; remove it from keras_dist.init")
    return cls(**options)
