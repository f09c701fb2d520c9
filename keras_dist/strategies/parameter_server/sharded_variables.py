"""Training a model whose variables a partitioner split over the ps tasks (`ShardedVariable`s).

The Keras bugs this meets are worked around in `keras_dist.keras_workarounds`
(keras-team/keras#18624); here is what the strategy builds on them.
"""

from collections.abc import Callable
from typing import Any

import keras
import tensorflow as tf

from keras_dist import keras_internals, keras_workarounds
from keras_dist.errors import KerasDistError
from keras_dist.overrides import override


def train_step(model: keras.Model) -> Callable[[Any], Any]:
    """Keras's `train_step` made to work with variables a partitioner split over ps tasks."""
    step = keras_workarounds.train_step_over_shards(model)
    if step is None:  # only frozen variables are sharded: Keras's step works
        return model.train_step
    if type(model).train_step is not keras_internals.tensorflow_trainer().train_step:
        raise KerasDistError(f"{type(model).__name__} overrides train_step, which cannot differentiate variables the "
                             "variable_partitioner split; drop variable_partitioner or use Keras's train_step")
    for option in ("weight_decay", "use_ema"):  # both update every variable through one colocated op
        if getattr(model.optimizer, option):
            raise KerasDistError(f"the optimizer's {option} cannot update variables the variable_partitioner split; "
                                 f"drop {option} or variable_partitioner")
    return step


def embedding_lookups_by_shard(model: keras.Model) -> None:
    """Makes each sharded `Embedding` of `model` gather its rows shard by shard.

    Keras's `Embedding` reads its whole table (`ops.take`), which for a ShardedVariable
    means copying every shard from the ps tasks on every step; `tf.nn.embedding_lookup`
    reads only the rows of the batch, and its gradient touches only those rows.

    Args:
        model: a built model; the `call` of each sharded `Embedding` (without LoRA or
            quantization) is replaced on that layer instance only.
    """
    for layer in keras_internals.flatten_layers(model):
        # Subclasses keep their own `call`: it may do more than look up rows. Idempotent:
        # each step function (train, test, predict) asks again.
        if type(layer).call is keras.layers.Embedding.call and "call" not in vars(layer) \
                and keras_workarounds.is_sharded(keras_internals.embeddings_variable(layer)) \
                and not layer.lora_enabled and not layer.quantization_mode:
            override(layer, "call", _lookup_by_shard(layer))


def _lookup_by_shard(layer):
    keras_call = layer.call

    def call(inputs):
        if isinstance(inputs, tf.SparseTensor):
            return keras_call(inputs)  # Keras combines sparse ids itself; it reads the whole table
        ids = inputs if inputs.dtype in (tf.int32, tf.int64) else tf.cast(inputs, tf.int32)
        ids = tf.where(ids < 0, ids + layer.input_dim, ids)  # as Keras's `take`: -1 is the last row
        # Dispatches to a per-shard gather for a ShardedVariable ("div" partitioning).
        table = keras_internals.variable_value(keras_internals.embeddings_variable(layer))
        return tf.cast(tf.nn.embedding_lookup(table, ids), layer.compute_dtype)

    return call
