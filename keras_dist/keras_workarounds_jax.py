"""The one place for what Keras's JAX trainer does under a distribution that costs keras_dist's JAX strategy.

As `keras_dist.keras_workarounds` (tf.distribute), each entry acts on one model instance
(never a Keras class) and has a canary in tests/test_keras_backends.py that asserts plain
Keras still behaves so. This module imports no TensorFlow.
"""

from collections.abc import Callable, Sequence
from typing import Any

from keras_dist.overrides import override


def metric_resets_keep_their_layout(model: Any, replicate: Callable[[Sequence[Any]], None]) -> None:
    """Keeps the metric states in the layout the train step returns them in, on this model.

    Upstream: not filed (Keras 3.15.1 and keras-nightly 3.16 alike). Under a
    `keras.distribution` Keras's `reset_metrics` (at every epoch's start) assigns zeros
    that land on one device, while the train step returns the states replicated over the
    mesh; JAX then traces and compiles the train step once more, for the first step's
    placement, in every `fit` (plain `keras.distribution.DataParallel` does it too). On a
    GPU that is a second compilation of the whole step (tens of seconds for ResNet-50).
    Here each reset ends with `replicate` of the model's metric variables.
    """
    reset = model.reset_metrics  # Keras's own: each compile first removes keras_dist's overrides

    def reset_metrics() -> None:
        reset()
        replicate(model.metrics_variables)

    override(model, "reset_metrics", reset_metrics)
