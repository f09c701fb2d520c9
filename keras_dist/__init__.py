"""keras_dist: distributed training for an unchanged Keras 3 script.

```python
import keras_dist
keras_dist.compile(model, optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64)   # per-replica batch; runs on every backend
```
"""

import os
import sys

from keras_dist import strategies as _strategies
from keras_dist.launchers import processes as _processes


def _is_the_cli():
    # `keras-dist info` / `launch` must never become a worker or server, even with a
    # (stale) TF_CONFIG in the shell; the tasks it launches are separate processes.
    program = (getattr(sys, "argv", None) or [""])[0]
    return os.path.basename(program) == "keras-dist" or program.endswith(os.path.join("keras_dist", "cli.py"))


if not _is_the_cli():
    # Settings TensorFlow reads once at start-up (thread pools, a strategy's server) must
    # be made before it starts, so the launcher's backend gets its say at import time.
    _strategies.strategy_class(_strategies.select()[0]).prepare_process(os.environ)
    _processes.watch_launcher(os.environ)

from keras_dist import callbacks  # noqa: E402
from keras_dist.compile import compile  # noqa: E402
from keras_dist.errors import KerasDistError  # noqa: E402
from keras_dist.runtime import current, init  # noqa: E402
from keras_dist.training import distribute_dataset  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KerasDistError", "callbacks", "compile", "current", "distribute_dataset", "init"]
