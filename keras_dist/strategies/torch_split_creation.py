"""Weights split from their creation on PyTorch (`keras_dist.split_weights`): each trainable
variable built in the block is made whole from its initializer, one at a time, and only
this process's flat slice of it is kept; `torch_split_weights.SplitWeights` then trains
and saves the model from those slices."""

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import keras

from keras_dist import keras_internals
from keras_dist.split_creation import SLICE

if TYPE_CHECKING:
    import torch


def slice_length(count: int, size: int) -> int:
    """The length of each of `size` equal flat slices of `count` elements (the last padded)."""
    return max(1, -(-count // size))


def flat_slice(torch: Any, whole: "torch.Tensor", rank: int, size: int) -> "torch.Tensor":
    """Slice `rank` of `size` equal slices of `whole`, flat and padded with zeros (a copy)."""
    length = slice_length(whole.numel(), size)
    if whole.numel() >= (rank + 1) * length:
        return whole.reshape(-1)[rank * length:(rank + 1) * length].clone()
    flat = torch.zeros((length * size,), dtype=whole.dtype, device=whole.device)
    with torch.no_grad():
        flat[:whole.numel()] = whole.reshape(-1)
    return flat[rank * length:(rank + 1) * length].clone()


@contextlib.contextmanager
def built_split(rank: int, size: int) -> Iterator[None]:
    """`keras_dist.split_weights` on PyTorch: Keras makes the variables built in the block
    without a value; at its end each trainable one is made whole from its initializer, one
    at a time, and only this process's slice is kept (`SLICE`); the others get their value."""
    import torch

    with keras_internals.made_without_values() as made:
        yield
    for variable in made:
        if not (variable.trainable and keras.backend.is_float_dtype(variable.dtype)):
            keras_internals.initialize_deferred(variable)
            continue
        initializer = keras_internals.take_initializer(variable)
        whole = keras.ops.convert_to_tensor(initializer(variable.shape, dtype=variable.dtype), dtype=variable.dtype)
        setattr(variable, SLICE, flat_slice(torch, whole.detach(), rank, size))
        del whole
        keras_internals.initialize_variable(variable, torch.empty((0,), dtype=_parameter_dtype(torch, variable.dtype)))


def _parameter_dtype(torch: Any, dtype: str) -> "torch.dtype":
    return getattr(torch, keras.backend.standardize_dtype(dtype))
