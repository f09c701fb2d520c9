"""keras_dist: distributed training for an unchanged Keras 3 script.

```python
import keras_dist
keras_dist.compile(model, optimizer="adam", loss="sparse_categorical_crossentropy")
model.fit(x, y, batch_size=64)   # per-replica batch; runs on every backend
```
"""

from keras_dist import startup as _startup

_startup.start()  # what importing keras_dist does to this process: see keras_dist.startup

from keras_dist import callbacks  # noqa: E402
from keras_dist.compile import compile  # noqa: E402
from keras_dist.errors import KerasDistError  # noqa: E402
from keras_dist.runtime import current, init  # noqa: E402
from keras_dist.inputs import distribute_dataset  # noqa: E402

__version__ = "0.1.0"
__all__ = ["KerasDistError", "callbacks", "compile", "current", "distribute_dataset", "init"]
