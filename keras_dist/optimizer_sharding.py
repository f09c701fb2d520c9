"""Optimizer state sharded across processes (`keras_dist.compile(..., shard="optimizer")`, ZeRO stage 1).

Every process keeps the whole model and computes gradients for all of it, as in data
parallel training; but each variable has one owner process (`owners`: consecutive
variables, about 1/N of the bytes each), and only the owner builds the optimizer's state
for it (Adam's two moments) and updates it. The updated variables then travel from their
owners to every other process. Per process, the optimizer's state is about 1/N of an
unsharded one's; the result is the unsharded update's, since every owner applies it to
the gradients reduced over all processes.

The optimizer's `build` and `apply` are replaced on the object (no Keras class is
patched): `build` makes state for the owned variables alone; `apply` reduces every
gradient, applies the owned ones with Keras's own `apply`, and hands the variables to
`broadcast_from_owners`. Clipping by global norm is done over every gradient first, so
Keras's own, over the owned ones, changes nothing more.
"""

import logging
from collections.abc import Callable, Sequence
from typing import Any

import keras
import numpy as np

from keras_dist.errors import KerasDistError
from keras_dist.overrides import is_overridden, override

logger = logging.getLogger("keras_dist")

# What a sharded job cannot save yet: every Keras save holds the optimizer's state, and a
# process holds its own share of it only.
NO_SAVES = ("a model compiled with shard='optimizer' cannot be saved yet (each process holds its share of the "
            "optimizer's state only, and a whole checkpoint needs all of it); drop shard to save or resume")


def check_level(shard: str, strategy: Any) -> None:
    """One line where `shard` is not a level, or not one this strategy (`Strategy`) shards."""
    if shard == "weights":
        raise KerasDistError("shard='weights' (weights sharded too) is not built yet; shard='optimizer' shards the "
                             "optimizer's state")
    if shard != "optimizer":
        raise KerasDistError(f"shard must be None or 'optimizer', got {shard!r}")
    if strategy.size > 1 and not strategy.shards_optimizer_state:
        raise KerasDistError(f"backend {strategy.name!r} cannot shard the optimizer's state yet; run on PyTorch "
                             "(KERAS_BACKEND=torch) or drop shard")


def refuse_saves(model: keras.Model) -> None:
    """Makes `model.save` and `save_weights` end in one line (`NO_SAVES`) on every process."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise KerasDistError(NO_SAVES)

    for name in ("save", "save_weights"):
        override(model, name, refused)


def refuse_file_callbacks(callbacks: Sequence[keras.callbacks.Callback], backup_dir: str | None) -> None:
    """One line, on every process, where `fit` would save a checkpoint or a backup (a callback
    of the script's, or keras_dist's own under `--backup-dir`)."""
    saving = [type(c).__name__ for c in callbacks
              if isinstance(c, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore))]
    if saving or backup_dir is not None:
        raise KerasDistError(f"{saving[0] if saving else 'keras-dist launch --backup-dir'}: {NO_SAVES}")


def owners(variables: Sequence[Any], size: int) -> list[int]:
    """The process that owns each variable: consecutive runs of about 1/`size` of the bytes,
    the same on every process (from the variables' shapes and dtypes alone)."""
    sizes = [int(np.prod(v.shape)) * np.dtype(keras.backend.standardize_dtype(v.dtype)).itemsize for v in variables]
    total = max(1, sum(sizes))
    start, found = 0, []
    for nbytes in sizes:
        # The owner is the process whose share holds the variable's middle byte.
        found.append(min(size - 1, (start + nbytes // 2) * size // total))
        start += nbytes
    return found


def check_supported(optimizer: keras.optimizers.Optimizer) -> None:
    """One line for what sharded state cannot do yet."""
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise KerasDistError("shard='optimizer' does not take a LossScaleOptimizer yet (mixed_float16); train in "
                             "float32 or bfloat16, or drop shard")
    if optimizer.use_ema:
        raise KerasDistError("shard='optimizer' does not take use_ema=True yet (each process would average only its "
                             "own variables); drop one of them")


def is_sharded(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `shard_state` made `optimizer` keep its own share of the state."""
    return is_overridden(optimizer, "build")


def shard_state(optimizer: keras.optimizers.Optimizer, rank: int, size: int,
                allreduce: Callable[[list], list], broadcast_from_owners: Callable[[list, list[int]], None]) -> None:
    """Makes `optimizer` keep state for, and update, the variables process `rank` owns.

    Args:
        optimizer: a Keras 3 optimizer, not yet built (`keras_dist.compile` makes it).
        rank, size: this process and the job's process count.
        allreduce: from a list of gradient tensors (no None) to the list reduced over processes.
        broadcast_from_owners: overwrites each variable everywhere with its owner's value
            (`variables`, and their owners' ranks).
    """
    if is_sharded(optimizer):
        return
    check_supported(optimizer)
    keras_build, keras_apply = optimizer.build, optimizer.apply
    placement: dict[tuple, list[int]] = {}

    def placed(variables: list) -> list[int]:
        key = tuple(id(v) for v in variables)
        if key not in placement:
            placement[key] = owners(variables, size)
        return placement[key]

    def build(variables: list) -> None:
        # Keras builds the optimizer from every trainable variable before the first step.
        keras_build([v for v, owner in zip(variables, placed(list(variables))) if owner == rank])

    def apply(grads: list, trainable_variables: Any = None) -> None:
        if trainable_variables is None:
            raise KerasDistError("a sharded optimizer's apply needs the variables with the gradients: "
                                 "optimizer.apply(grads, variables)")
        variables = list(trainable_variables)
        owner = placed(variables)
        present = [i for i, g in enumerate(grads) if g is not None]
        reduced = dict(zip(present, allreduce([grads[i] for i in present])))
        grads = [reduced.get(i) for i in range(len(variables))]
        if optimizer.global_clipnorm:
            grads = _clip_by_global_norm(grads, optimizer.global_clipnorm)
        mine = [i for i in present if owner[i] == rank]
        if mine:
            keras_apply([grads[i] for i in mine], [variables[i] for i in mine])
        else:  # Keras counts no iteration for no gradients; the others count one
            optimizer.iterations.assign_add(1)
        broadcast_from_owners([variables[i] for i in present], [owner[i] for i in present])

    override(optimizer, "build", build)
    override(optimizer, "apply", apply)


def _clip_by_global_norm(grads: list, clip_norm: float) -> list:
    """`grads` scaled so that their joint norm is at most `clip_norm`, as Keras clips them."""
    present = [g for g in grads if g is not None]
    norm = keras.ops.sqrt(sum(keras.ops.sum(keras.ops.square(g)) for g in present))
    scale = keras.ops.minimum(1.0, clip_norm / keras.ops.maximum(norm, 1e-12))
    return [None if g is None else g * keras.ops.cast(scale, g.dtype) for g in grads]
