"""keras_dist: distributed training for an unchanged Keras 3 script.

```python
import keras_dist
keras_dist.compile(model, optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64)   # per-replica batch; runs on every backend
```
"""

import importlib

from keras_dist import startup as _startup
from keras_dist.errors import KerasDistError

_startup.start()  # what importing keras_dist does to this process: see keras_dist.startup
if not _startup.is_the_cli():
    # Registers keras_dist's serializable classes (ScaledSchedule) with Keras, so that a
    # script can load a saved model before it compiles one.
    from keras_dist.compile import compile  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KerasDistError", "callbacks", "compile", "current", "distribute_dataset", "init", "local",
           "notebook_launcher", "split_weights"]

# The public names, imported on first use (by scripts, `compile` at once): they import
# Keras, which tools (`keras-dist launch`, `keras-dist info`) never need.
_LAZY = {"callbacks": ("keras_dist.callbacks", None), "compile": ("keras_dist.compile", "compile"),
         "current": ("keras_dist.runtime", "current"), "init": ("keras_dist.runtime", "init"),
         "distribute_dataset": ("keras_dist.runtime", "distribute_dataset"),
         "local": ("keras_dist.compiled_elsewhere", "local"),
         "notebook_launcher": ("keras_dist.notebook", "notebook_launcher"),
         "split_weights": ("keras_dist.runtime", "split_weights")}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'keras_dist' has no attribute {name!r}")
    module, attribute = _LAZY[name]
    value = importlib.import_module(module)
    if attribute is not None:
        value = getattr(value, attribute)
    # Importing the submodule `keras_dist.compile` bound that name to the module: the function wins.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
