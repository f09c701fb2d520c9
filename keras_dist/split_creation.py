"""The mark of a model built in `keras_dist.split_weights()` (`runtime.split_weights`): its
trainable weights split over the job's processes from the start, so that no process ever
holds the whole model (PyTorch).

`keras_dist.compile(..., shard="weights")` splits a model built whole at fit's start;
that cannot help a model whose weights one process cannot hold. Built inside
`split_weights()`, each trainable variable is made from its initializer one at a time,
cut into N flat slices, and only this process's slice is kept (the whole value lives for
that one variable's length: the peak is the largest variable, not the model). The
slices are the values the unsharded model gets from the same seed (the job's processes
share one, `keras_dist.startup`). Keras makes every variable inside the block without a
value (a `keras.StatelessScope`), as it does for a model it traces, so the model must be
built inside it (`keras.Input`, or `model.build(shape)`).

Such a model stays split for good (`keras_dist.strategies.torch_split_weights`): fit
gathers each layer's weights where it runs; `model.save` and `save_weights`, called on
every process, gather one layer at a time as Keras writes it; `load_weights` and
`load_model` take each process's slice of each variable as Keras reads it.
"""

from typing import Any

# A model split for good is written a layer at a time, by the script's saves on every
# process and by fit's checkpoints; a save of one process alone would hold it whole.
NOT_SAVED_WHOLE = ("a model built in keras_dist.split_weights() is saved a layer at a time by model.save and "
                   "model.save_weights called on every process, and by fit's checkpoints; model.export (or a save "
                   "on one process) would hold it whole in one process, which keras_dist does not do yet: save the "
                   "weights, or build the model outside split_weights() (docs/sharding.md)")

# On a variable made inside `split_weights`: this process's flat slice of it, which stays
# its value's one home (its own data is released).
SLICE = "_keras_dist_created_slice"


def built_split(model: Any) -> bool:
    """Whether `model` was built inside `split_weights` (some variable of it is a slice)."""
    return any(SLICE in vars(variable) for variable in getattr(model, "weights", ()))

