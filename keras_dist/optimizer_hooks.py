"""Per-instance hooks that make a Keras 3 optimizer reduce gradients across processes.

Keras 3 optimizers funnel every update through `BaseOptimizer._clip_gradients`, exactly
once per applied update: after loss-scale unscaling, after `gradient_accumulation_steps`
micro-batches have been summed, and before clipping, weight decay and the update rule.
Reducing there gives, for any optimizer (built-in, schedule-driven or user subclass):

* one fused collective per applied update, not one per micro-batch;
* clipping applied to the global gradient, as a single process at the global batch does.

The hook is installed on the optimizer object only (no Keras class is patched), so
serialization (`model.save`) still records the user's own optimizer class.
"""

import types
from collections.abc import Callable, Iterable
from typing import Any

import keras

from keras_dist import keras_internals
from keras_dist.overrides import override

_HOOKED = "_keras_dist_reduces_gradients"


def reduce_gradients_before_update(optimizer: keras.optimizers.Optimizer, allreduce: Callable[[list], Iterable],
                                   all_finite: Callable[[Any], Any] | None = None) -> None:
    """Makes `optimizer` pass its gradients through `allreduce` before each update.

    Args:
        optimizer: a Keras 3 optimizer, possibly a `LossScaleOptimizer`.
        allreduce: function from a list of gradient tensors to the reduced list; called
            inside the compiled train step.
        all_finite: function from this process's "gradients are finite" boolean tensor to
            the logical AND over processes. Needed for loss scaling: every process must
            take the same skip-or-apply branch, or the collective inside it would hang.

    Example:

    ```python
    reduce_gradients_before_update(model.optimizer, lambda g: hvd.grouped_allreduce(g))
    ```
    """
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        if all_finite is not None and not getattr(optimizer, _HOOKED, False):
            local_check = optimizer.check_finite
            override(optimizer, "check_finite", types.MethodType(lambda self, grads: all_finite(local_check(grads)), optimizer))
            override(optimizer, _HOOKED, True)
        optimizer = optimizer.inner_optimizer
    if getattr(optimizer, _HOOKED, False):
        return
    clip = keras_internals.gradient_clipper(optimizer)

    def reduce_then_clip(self, grads):
        return clip(list(allreduce(grads)))

    override(optimizer, "_clip_gradients", types.MethodType(reduce_then_clip, optimizer))
    override(optimizer, _HOOKED, True)


def optimizers_of(model: keras.Model) -> list[keras.optimizers.Optimizer]:
    """Every Keras optimizer `model` holds: `model.optimizer` and any held as an attribute.

    A model whose `compile` takes its own optimizers (a GAN's `d_optimizer` and
    `g_optimizer`) keeps them as attributes, directly or in a list or dict; each of them
    must reduce gradients, or the replicas drift apart.
    """
    found = {}
    for value in [model.optimizer, *vars(model).values()]:
        parts = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else [value]
        for part in parts:
            if isinstance(part, keras.optimizers.Optimizer):
                found.setdefault(id(part), part)
    return list(found.values())
