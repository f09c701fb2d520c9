"""The one place for what Keras's PyTorch trainer does that keras_dist's PyTorch strategy does itself.

As `keras_dist.keras_workarounds` (tf.distribute), each entry names its upstream change,
acts on one model instance (never a Keras class) and has a canary in
tests/test_keras_internals.py. This module imports no TensorFlow.
"""

from typing import Any

from keras_dist import keras_internals
from keras_dist.overrides import override


def one_reduction_per_step(model: Any) -> None:
    """Keeps Keras 3.16's torch trainer from reducing what keras_dist reduces, on this model.

    Upstream: keras-team/keras#23316 (Keras 3.16). Wherever `torch.distributed` is
    initialized, Keras wraps the model in `DistributedDataParallel` when it makes a train,
    test or predict function, and all-reduces the metric states in every train and test
    step (`get_metrics_result`). keras_dist's PyTorch strategy already all-reduces the
    gradients, in buckets started during the backward pass, with its compression, the
    all-finite check and the step timeout, and sums metric states where and when logs
    need them; with both, every step reduced its gradients twice, and an evaluation whose
    shards differ by a batch would meet an all-reduce on one process only. Here Keras's wrapping does nothing on this model,
    and its `get_metrics_result` is the trainer mixin's, which reads this process's states.
    Before 3.16 neither exists and nothing changes.
    """
    initializer = keras_internals.torch_ddp_initializer()
    if initializer is None:
        return
    override(model, initializer, lambda: None)
    override(model, "get_metrics_result", lambda: keras_internals.base_metrics_result(model))
