"""`keras_dist.compile`: the one call that replaces `model.compile`."""

from typing import Any, Literal

import keras

from keras_dist import (compiled_elsewhere, keras_internals, optimizer_hooks, optimizer_sharding, overrides, runtime,
                        split_creation, training)
from keras_dist.strategies.base import GradientOptions
from keras_dist.errors import KerasDistError


def compile(
    model: keras.Model,
    *args: Any,
    gradient_reduction: Literal["mean", "sum"] = "mean",
    gradient_compression: Literal["fp16", "bf16"] | None = None,
    scale_learning_rate: bool = False,
    shard: Literal["optimizer", "weights"] | None = None,
    **kwargs: Any,
) -> None:
    """Compiles `model` for distributed training on the active strategy.

    Takes the same arguments as `model.compile`. Afterwards the model's unchanged
    `fit`, `evaluate` and `predict` run on every replica: batch sizes are per replica,
    inputs are split across replicas, gradients and metrics are reduced across them and
    only the chief writes checkpoints, TensorBoard logs and CSV logs.

    Args:
        model: a `keras.Model`.
        *args: passed to `model.compile` (optimizer, loss, ...).
        gradient_reduction: `"mean"` (default) or `"sum"` of the replicas' gradients.
        gradient_compression: `None`, `"fp16"` or `"bf16"`, the dtype gradients travel
            in, on the backends whose all-reduce keras_dist runs: Horovod (fp16) and
            PyTorch (both; bf16 keeps float32's range); the others refuse it. It pays on
            slow links only (docs/benchmarks.md).
        scale_learning_rate: multiply the optimizer's learning rate by the number of
            replicas (pair it with `keras_dist.callbacks.LearningRateWarmup`).
        shard: `None` (default), or `"optimizer"`: each process keeps the optimizer's
            state (Adam's moments) for its share of the variables only, about 1/N of it,
            and updates those; the result is the unsharded one's (ZeRO stage 1; PyTorch, JAX,
            and TensorFlow under Horovod). `"weights"` (JAX, PyTorch): the model's trainable
            weights are split over the processes too while fit runs, each gathered where
            the step uses it (ZeRO stage 3, docs/sharding.md). Unset: `KERAS_DIST_SHARD`'s, if set;
            `"weights"` for a model built in `keras_dist.split_weights()`.
        **kwargs: passed to `model.compile`.

    `keras_dist.compile(model)` alone recompiles a compiled model (one `keras.models.load_model`
    returned) with its own settings and optimizer, whose state it keeps.

    Example:

    ```python
    import keras_dist
    keras_dist.compile(model, optimizer="adam", loss="mse", metrics=["mae"])
    model.fit(x, y, batch_size=32, epochs=3)
    ```
    """
    if not _is_trainer(model):
        raise KerasDistError(
            f"keras_dist.compile expects a keras.Model as its first argument, got "
            f"{type(model).__name__}; call keras_dist.compile(model, optimizer=..., loss=...)"
        )
    if gradient_reduction not in ("mean", "sum"):
        raise KerasDistError(f"gradient_reduction must be 'mean' or 'sum', got {gradient_reduction!r}")
    if gradient_compression not in (None, "fp16", "bf16"):
        raise KerasDistError(f"gradient_compression must be None, 'fp16' or 'bf16', got {gradient_compression!r}")
    strategy = runtime.current()
    shard = shard if shard is not None else strategy.settings.shard
    if strategy.size > 1 and split_creation.built_split(model):
        if not args and not kwargs and model.compiled:
            raise KerasDistError("a model built in keras_dist.split_weights() is compiled again with its arguments "
                                 "(its optimizer's state is split): keras_dist.compile(model, optimizer=..., loss=...)")
        if shard not in (None, "weights"):
            raise KerasDistError(f"the model was built in keras_dist.split_weights(), so its weights stay split: "
                                 f"compile it with shard='weights' (or none), not shard={shard!r}")
        shard = "weights"
    if not args and not kwargs and model.compiled:
        kwargs = _compiled_with(model)
    if shard is not None:
        optimizer_sharding.check_level(shard, strategy)
    overrides.restore(model)  # compiled before: start again from Keras's own methods
    strategy.prepare_model(model)
    kwargs = strategy.compile_arguments(kwargs)
    with strategy.scope(), compiled_elsewhere.compiling_here(model):
        model.compile(*args, **kwargs)
    options = GradientOptions(gradient_reduction, gradient_compression, shard if strategy.size > 1 else None)
    for optimizer in optimizer_hooks.optimizers_of(model):
        for part in (optimizer, getattr(optimizer, "inner_optimizer", None)):  # a LossScaleOptimizer's too
            if part is not None:
                overrides.restore(part)
        if scale_learning_rate:
            with strategy.scope():
                _scale_learning_rate(optimizer, strategy.num_replicas)
        strategy.distribute_optimizer(optimizer, options)
    training.attach(model, strategy, options)
    strategy.after_compile(model)


compiled_elsewhere.distribute_through(compile)


def _compiled_with(model: keras.Model) -> dict:
    """The `compile` arguments a compiled model was given (by `keras.models.load_model` from its
    file, or by `model.compile`), with its optimizer itself: its state (a loaded one's too) is kept."""
    config = model.get_compile_config()
    if config is None:
        raise KerasDistError(f"keras_dist.compile(model) without arguments recompiles a compiled model with its own "
                             f"settings, but {model.name!r} keeps none; pass them: keras_dist.compile(model, "
                             "optimizer=..., loss=...)")
    arguments = keras.saving.deserialize_keras_object(config)
    return {**arguments, "optimizer": model.optimizer}


def _is_trainer(model: Any) -> bool:
    """A `keras.Model`, or a layer that mixes in Keras's `Trainer` as Keras's own tests do."""
    return isinstance(model, (keras.Model, keras_internals.trainer_mixin()))


def _scale_learning_rate(optimizer, factor):
    rate = keras_internals.learning_rate_schedule(optimizer)
    if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule):
        optimizer.learning_rate = ScaledSchedule(rate, factor)
    else:
        optimizer.learning_rate = float(keras.ops.convert_to_numpy(optimizer.learning_rate)) * factor


@keras.saving.register_keras_serializable(package="keras_dist")
class ScaledSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """A learning-rate schedule multiplied by a constant (the number of replicas).

    Args:
        schedule: the `LearningRateSchedule` to scale.
        factor: the multiplier.
    """

    def __init__(self, schedule: keras.optimizers.schedules.LearningRateSchedule, factor: float) -> None:
        self.schedule = schedule
        self.factor = factor

    def __call__(self, step: Any) -> Any:
        return self.schedule(step) * self.factor

    def get_config(self) -> dict:
        return {"schedule": keras.saving.serialize_keras_object(self.schedule), "factor": self.factor}

    @classmethod
    def from_config(cls, config: dict) -> "ScaledSchedule":
        return cls(keras.saving.deserialize_keras_object(config["schedule"]), config["factor"])
