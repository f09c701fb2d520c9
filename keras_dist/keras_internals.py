"""Every private Keras name keras_dist uses (`keras.src`, `_attributes`), and why it has no public one.

This is the only place keras_dist touches `keras.src` or a Keras object's private attribute
(besides the name of a method that `keras_dist.overrides` replaces on one object); every
function here has a canary in tests/test_keras_internals.py, which names the Keras internal
that moved and what in keras_dist depends on it, and tests/test_house.py fails if another
module of keras_dist uses a private Keras name. setup.cfg's Keras range is the one these
were tested on.

Nothing is imported here before it is used: `import keras_dist` imports no Keras for the
`keras-dist` command, and the TensorFlow trainer's names are imported only under the
TensorFlow backend (a JAX or PyTorch install has no TensorFlow). Differences between the
Keras releases in that range are absorbed here, not at the call sites.
"""

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

# --- the TensorFlow trainer (keras.src.backend.tensorflow.trainer): imported only where used ---


def reduce_per_replica(values: Any, strategy: Any, reduction: str) -> Any:
    """Keras's reduction of a step's per-replica logs, which keras_workarounds' step function keeps for non-scalar logs; private to the TF trainer."""
    from keras.src.backend.tensorflow.trainer import reduce_per_replica as keras_reduce

    return keras_reduce(values, strategy, reduction=reduction)


def concat(tensors: list, axis: int = 0) -> Any:
    """Keras's concatenation of per-replica outputs (dense, sparse or ragged), for MultiWorkerMirrored's local predict; private to the TF trainer."""
    from keras.src.backend.tensorflow.trainer import concat as keras_concat

    return keras_concat(tensors, axis=axis)


def tensorflow_trainer() -> type:
    """Keras's TF trainer (`TensorFlowTrainer`, `Trainer` in 3.16's nightlies), against whose steps keras_dist tells a model's own; no public class."""
    from keras.src.backend.tensorflow import trainer

    return getattr(trainer, "TensorFlowTrainer", None) or trainer.Trainer


def step_function_maker(model: Any) -> Any:
    """The TF trainer's `_make_function` of `model` (bound), which makes the train, test or predict function of a step, and which keras_workarounds wrap; private method."""
    return model._make_function


def set_distribute_strategy(model: Any, strategy: Any) -> None:
    """Makes a TF-backend model run its steps under `strategy` (`_distribute_strategy`, which Keras sets when a model is made under a scope), for a model made outside one; private attribute."""
    # Not `setattr`: Keras's layer tracking would take the strategy for state.
    object.__setattr__(model, "_distribute_strategy", strategy)


def tf_distributed_update(optimizer: Any) -> Any:
    """A TF-backend optimizer's `_distributed_tf_update_step` (bound), which applies the gradients through `strategy.extended.update` and which keras_workarounds wrap for sharded variables; private method."""
    return optimizer._distributed_tf_update_step


def set_optimizer_strategy(optimizer: Any, strategy: Any) -> None:
    """Makes a TF-backend optimizer create and update its variables under `strategy` (`_distribution_strategy`, the strategy current when it was made); private attribute."""
    optimizer._distribution_strategy = strategy


# --- trainers, optimizers, losses ------------------------------------------------------------


def trainer_mixin() -> type:
    """Keras's trainer mixin (`Trainer`, `BaseTrainer` in 3.16's nightlies), which keras_dist.compile accepts besides `keras.Model`, as Keras's own tests compile such layers; not public."""
    from keras.src.trainers import trainer

    return getattr(trainer, "Trainer", None) or trainer.BaseTrainer


def loaded_get_file_code() -> Any:
    """The code object of `keras.utils.get_file` once Keras has loaded it (else None, importing nothing), whose frame keras_dist.downloads finds on the stack when it makes its cache directory (its local `datadir`); the function is public, its module and locals are not."""
    import sys

    module = sys.modules.get("keras.src.utils.file_utils")
    return None if module is None else module.get_file.__code__


@functools.cache
def compile_code() -> Any:
    """The code object of Keras's own `compile` (the trainer mixin's, under its decorators), whose frame keras_dist.compiled_elsewhere finds on the stack while Keras creates a variable in it; not public."""
    import inspect

    return inspect.unwrap(trainer_mixin().compile).__code__


def symbolic_build(model: Any, batch: Any) -> None:
    """Builds a model's variables, its metrics' and its optimizer's from one batch, as fit does before its first step, which parameter servers need before any step runs on a worker; private method."""
    model._symbolic_build(data_batch=batch)


def should_evaluate(model: Any, epoch: int, validation_freq: Any) -> bool:
    """Whether fit validates after `epoch` under `validation_freq`, Keras's rule, which the parameter-server loop follows; private method."""
    return model._should_eval(epoch, validation_freq)


def metrics_in_order(model: Any, logs: dict) -> Any:
    """`evaluate`'s logs as the list Keras returns without `return_dict`, which the parameter-server loop returns too; private method."""
    return model._flatten_metrics_in_order(logs)


def call_has_training_argument(model: Any) -> bool:
    """Whether `model.call` takes `training` (`_call_has_training_arg`; Keras's train_step passes it then), which keras_workarounds' step over shards follows; private attribute."""
    return model._call_has_training_arg


def compute_loss(model: Any, x: Any, y: Any, y_pred: Any, sample_weight: Any = None, training: bool = True) -> Any:
    """The loss as Keras's train_step computes it (`_compute_loss`: the model's `compute_loss`, with `training` where that takes it), for keras_workarounds' step over shards; private method."""
    return model._compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training)


def loss_tracker(model: Any) -> Any:
    """The `Mean` metric in which Keras's train_step records the loss (`_loss_tracker`, the `loss` log), for keras_workarounds' step over shards; private attribute."""
    return model._loss_tracker


def base_metrics_result(model: Any) -> dict:
    """The metric results of `model`'s own states, by Keras's trainer mixin: 3.16's torch trainer overrides `get_metrics_result` to all-reduce them in every step (keras#23316), which keras_workarounds_torch turns off; no public name."""
    return trainer_mixin().get_metrics_result(model)


def torch_ddp_initializer() -> str | None:
    """The name of the torch trainer's method that wraps a model in DistributedDataParallel whenever torch.distributed is up (Keras 3.16, keras#23316; None before), which keras_workarounds_torch turns off per model; private."""
    from keras.src.backend.torch import trainer

    torch_trainer = getattr(trainer, "Trainer", None) or trainer.TorchTrainer
    return "_initialize_ddp" if hasattr(torch_trainer, "_initialize_ddp") else None


def base_optimizer() -> type:
    """Keras's `BaseOptimizer`, whose `add_variable_from_reference` creates a sharded variable's slots without the TF optimizer's colocation; `keras.optimizers.Optimizer` is the backend's subclass."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


def gradient_clipper(optimizer: Any) -> Any:
    """An optimizer's `_clip_gradients` (bound), which its `apply` runs on the gradients before the update, and which keras_dist.optimizer_hooks wraps to reduce them across processes first; private method."""
    return optimizer._clip_gradients


def reindex_optimizer_variables(optimizer: Any) -> None:
    """Rebuilds a built optimizer's index of the variables it updates (`_trainable_variables_indices`, keyed by `_var_key`: under TensorFlow the backing tf.Variable), after keras_dist replaced their tf.Variables; private attributes."""
    optimizer._trainable_variables_indices = {optimizer._var_key(v): i
                                              for i, v in enumerate(optimizer._trainable_variables)}


def unscale_loss_for_distribution(value: Any) -> Any:
    """The loss as Keras's loss tracker records it (undoing the per-replica scaling), in the parameter-server step over shards; private to Keras's losses."""
    from keras.src.losses.loss import unscale_loss_for_distribution as keras_unscale

    return keras_unscale(value)


def compute_output_spec(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Keras's symbolic call of `fn`, which builds a model's variables before the parameter-server predict closures; the backend function is not exported."""
    from keras.src.backend import compute_output_spec as keras_compute_output_spec

    return keras_compute_output_spec(fn, *args, **kwargs)


def get_data_adapter(x: Any, y: Any = None, sample_weight: Any = None, batch_size: Any = None,
                     steps_per_epoch: Any = None, shuffle: Any = False, class_weight: Any = None) -> Any:
    """Keras's data adapter for the inputs `fit` takes, which the parameter-server coordinator reads as Keras would, and keras_dist.inputs.arrays.EpochBatches wraps for its `EpochRows`; no public name."""
    from keras.src.trainers.data_adapters import get_data_adapter as keras_get_data_adapter

    return keras_get_data_adapter(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps_per_epoch,
                                  shuffle=shuffle, class_weight=class_weight)


def data_adapter_class() -> type:
    """Keras's `DataAdapter` base, which `fit` takes as its input as it is (keras_dist.inputs.arrays.EpochBatches: the batches keras_dist orders, as Keras's array adapter structures them); no public name."""
    from keras.src.trainers.data_adapters.data_adapter import DataAdapter

    return DataAdapter


def packed_arrays(x: Any, y: Any = None, sample_weight: Any = None, class_weight: Any = None) -> Any:
    """The arrays Keras's array adapter slices for `fit(x, y, sample_weight=..., class_weight=...)`, packed as it packs them (x alone without y; one sample_weight repeated for each output; class_weight as sample weights), which keras_dist.inputs.arrays.EpochRows batches in its own order; private attribute."""
    from keras.src.trainers.data_adapters.array_data_adapter import ArrayDataAdapter

    return ArrayDataAdapter(x, y, sample_weight, class_weight=class_weight)._inputs


# --- array slicing (keras.src.trainers.data_adapters.array_slicing) --------------------------
# Where Keras's array adapter and `validation_split` slice: keras_dist.inputs.arrays cuts
# shares with it, so that every leaf type Keras takes keeps its type.


def can_slice_array(x: Any) -> bool:
    """Whether Keras's array adapter slices `x`, which keras_dist.inputs.arrays asks to tell arrays from other inputs; not public."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.can_slice_array(x)


def convert_to_sliceable(arrays: Any, target_backend: str | None = None) -> Any:
    """Keras's sliceable wrapper of each leaf, with which keras_dist.inputs.arrays cuts shares and feeds tf.data as Keras does; not public."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.convert_to_sliceable(arrays, target_backend=target_backend)


def take_batch(sliceable: Any, rows: Any, target_backend: str) -> Any:
    """The rows `rows` of one of Keras's sliceables (`convert_to_sliceable`), converted as Keras's array adapter converts a batch for `target_backend` (TensorFlow: sparse leaves as a `tf.SparseTensor`, which it gathers in tf.data from a wrapper of one), which keras_dist.inputs.arrays.EpochRows serves; private classes."""
    from keras.src.trainers.data_adapters import array_slicing, data_adapter_utils

    batch = sliceable[rows]
    if target_backend == "tensorflow":
        if data_adapter_utils.is_tensorflow_tensor(batch):  # dense, sparse or ragged already
            return batch
        batch = sliceable.convert_to_tf_dataset_compatible(batch)
        return batch.sparse if isinstance(batch, array_slicing.TensorflowSparseWrapper) else batch
    if target_backend == "jax":
        return sliceable.convert_to_jax_compatible(batch)
    if target_backend == "torch":
        return sliceable.convert_to_torch_compatible(batch)
    return sliceable.convert_to_numpy(batch)


def gather_batch(indices: Any, arrays: Any) -> Any:
    """The rows `indices` of `arrays` (`convert_to_sliceable(..., "tensorflow")`, as tf.data holds them), gathered inside tf.data as Keras's array adapter gathers a batch (a sparse leaf from its wrapper), which keras_dist.inputs.arrays.EpochBatches does for its own order; nested private function."""
    import keras
    import tensorflow as tf
    from keras.src.trainers.data_adapters import array_slicing

    def grab(leaf):
        if isinstance(leaf, array_slicing.TensorflowSparseWrapper):
            return array_slicing.slice_tensorflow_sparse_wrapper(leaf, indices)
        if isinstance(leaf, (list, tuple, dict)):
            return None  # traversed further
        return tf.gather(leaf, indices, axis=0) if tf.is_tensor(leaf) else leaf

    return keras.tree.traverse(grab, arrays)


def train_validation_split(arrays: Any, validation_split: float) -> tuple[Any, Any]:
    """Keras's `validation_split`, which keras_dist.inputs.arrays applies before sharding so the held-out rows match one process's; not public."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


# --- variables (keras.src.backend.common.variables.Variable and each backend's) ----------------


def variable_value(variable: Any) -> Any:
    """The backend's value behind a Keras variable (`_value`: a tf.Variable under TensorFlow, a jax.Array under JAX; None before it is made, or for an object that is no Keras variable), which keras_dist moves, shards and places; private attribute."""
    return getattr(variable, "_value", None)


def initialize_variable(variable: Any, value: Any, trainable: bool | None = None) -> None:
    """Creates the backend's value of a Keras variable anew from `value`, in the current scope (`_initialize`); under TensorFlow the tf.Variable is made `trainable` where given, the Keras flag it is otherwise made with (`_trainable`) kept as it is; private method and attribute."""
    if trainable is None:
        variable._initialize(value)
        return
    keras_trainable, variable._trainable = variable._trainable, trainable
    try:
        variable._initialize(value)
    finally:
        variable._trainable = keras_trainable


def deferred_variables() -> list:
    """The variables made inside a `keras.StatelessScope` and not yet given a value (the global `uninitialized_variables`, which the scope's exit initializes unless told not to), which keras_dist's `split_weights` initializes as slices; private global state."""
    from keras.src.backend.common import global_state

    return global_state.get_global_attribute("uninitialized_variables", [], set_to_default=True)


@contextlib.contextmanager
def made_without_values() -> Iterator[list]:
    """Keras makes the variables built in the block without a value (a `keras.StatelessScope`, as when it traces a model); at the block's end the list it yields holds them, taken off Keras's pending ones (`deferred_variables`), for keras_dist's `split_weights` to give each its value; private global state."""
    import keras

    known = {id(v) for v in deferred_variables()}
    made: list = []
    with keras.StatelessScope(initialize_variables=False):
        yield made
    pending = deferred_variables()
    made.extend(v for v in pending if id(v) not in known)
    pending[:] = [v for v in pending if id(v) in known]


def take_initializer(variable: Any) -> Any:
    """The initializer a variable made in a stateless scope waits for (`_initializer`), dropped from it as Keras's `_deferred_initialize` drops it, for keras_dist's `split_weights`; private attribute."""
    initializer, variable._initializer = variable._initializer, None
    return initializer


def initialize_deferred(variable: Any) -> None:
    """Gives a variable made in a stateless scope its value from its initializer, as the scope's exit would (`_deferred_initialize`); private method."""
    variable._deferred_initialize()


def set_variable_aggregation(variable: Any, aggregation: str) -> None:
    """Sets how tf.distribute aggregates a Keras variable's updates (`_aggregation`, which its next tf.Variable is made with; the public `aggregation` is read-only); private attribute."""
    variable._aggregation = aggregation


def jax_sharding(variable: Any) -> Any:
    """The jax sharding of a JAX variable's layout (`_layout`, asked of the current distribution by `_initialize_layout` where it has none; None without a distribution), by which keras_dist's JAX strategy places it without a collective; private attribute and method."""
    if variable._layout is None:
        variable._initialize_layout()
    layout = variable._layout
    if layout is None:
        return None
    return layout.backend_layout if hasattr(layout, "backend_layout") else layout


def set_jax_value(variable: Any, value: Any) -> None:
    """Replaces the jax.Array behind a JAX variable (`_value`) as it is (`assign` would place it by the variable's layout), for keras_dist's JAX strategy, which places it itself; private attribute."""
    variable._value = value


def set_jax_layout(variable: Any, layout: Any) -> None:
    """Gives a JAX variable the layout (`_layout`) by which `jax_sharding` places it, for keras_dist's weights split over the mesh during fit; private attribute."""
    variable._layout = layout


def drop_jax_layout(variable: Any) -> None:
    """Forgets a JAX variable's layout (`_layout`): its value stays where it is until `jax_sharding` asks the distribution again, for keras_dist's steps on one process's devices; private attribute."""
    variable._layout = None


# --- layers and epoch iterators -----------------------------------------------------------------


def seed_generators(layer: Any) -> list:
    """The `SeedGenerator`s a layer draws its randomness from (`_seed_generators`: Dropout's, a RandomFlip's), whose states keras_dist's resume saves and restores; private attribute."""
    return getattr(layer, "_seed_generators", [])


def embeddings_variable(layer: Any) -> Any:
    """An `Embedding`'s table as created (`_embeddings`; the public `embeddings` adds LoRA's update and unpacks int4), whose shards keras_dist's parameter servers read row by row; private attribute."""
    return layer._embeddings


def batch_enumerator(epoch_iterator: Any) -> Any:
    """An epoch iterator's `_enumerate_iterator` (bound), each epoch's generator of (first step, last step, batch iterator), which keras_dist's resume replaces on one iterator to start an epoch at a step; private method."""
    return epoch_iterator._enumerate_iterator


# --- saving (keras.src.saving.saving_lib) -----------------------------------------------------


def learning_rate_schedule(optimizer: Any) -> Any:
    """An optimizer's learning rate as set: the schedule itself where there is one (the public property gives its current value), which keras_dist.compile scales; private attribute."""
    return optimizer._learning_rate


def optimizer_variables(optimizer: Any) -> list:
    """The variables a built optimizer updates, in its order, whose gradients the torch backend reduces in buckets during the backward pass; private attribute."""
    return optimizer._trainable_variables


def h5_io_store() -> type:
    """Keras's `.weights.h5` store, which background backups subclass (host copies) and write with, so the file is `save_weights`'s; not public."""
    from keras.src.saving import saving_lib

    return saving_lib.H5IOStore


def save_state(saveable: Any, weights_store: Any) -> None:
    """Keras's walk of a model's saved state into a weights store, which background backups run to copy it to host memory; private to saving_lib."""
    from keras.src.saving import saving_lib

    saving_lib._save_state(saveable, weights_store=weights_store, assets_store=None, inner_path="",
                           visited_saveables=set())


# --- callbacks: BackupAndRestore's files and position, the saves, the model, TensorBoard's step --


def backup_files(backup: Any) -> tuple[str, str]:
    """The weights and training-metadata files a `BackupAndRestore` saves to, which keras_dist commits atomically and reads its position from; private attributes."""
    return backup._weights_path, backup._training_metadata_path


def set_backup_files(backup: Any, weights: str, metadata: str) -> None:
    """Points a `BackupAndRestore`'s next save at other files (keras_dist's partial names, renamed once written); private attributes."""
    backup._weights_path, backup._training_metadata_path = weights, metadata


def previous_backup_files(backup: Any) -> tuple[str, ...]:
    """The files a `BackupAndRestore` with `double_checkpoint` (Keras >= 3.9) keeps of the state before, which keras_dist's commit writes first; private attributes."""
    if not getattr(backup, "double_checkpoint", False):
        return ()
    return backup._prev_weights_path, backup._prev_training_metadata_path


def set_backup_position(backup: Any, epoch: int | None = None, batch: int | None = None) -> None:
    """Sets where a `BackupAndRestore` counts its fit to be (epoch, last batch), which its next save records, for keras_dist's saves inside an epoch; private attributes."""
    if epoch is not None:
        backup._current_epoch = epoch
    if batch is not None:
        backup._last_batch_seen = batch


def initial_epoch(model: Any) -> int | None:
    """The epoch a `BackupAndRestore` told the model's fit to start at (None: none did), which keras_dist's resume and loops read and agree on; private attribute."""
    return model._initial_epoch


def set_initial_epoch(model: Any, epoch: int | None) -> None:
    """Tells the model's fit to start at `epoch`, as a restored `BackupAndRestore` does, for keras_dist's resume inside an epoch and its chief's choice; private attribute."""
    model._initial_epoch = epoch


def flatten_layers(model: Any) -> list:
    """Every layer of a model, nested ones included, which keras_dist walks for seed generators and sharded embeddings; private method."""
    return list(model._flatten_layers())


def sublayers(layer: Any) -> list:
    """The layers a layer holds directly (not theirs), which keras_dist's split weights walk to find each variable's layer; private method."""
    return list(layer._flatten_layers(include_self=False, recursive=False))


def own_trainable_variables(layer: Any) -> list:
    """The trainable variables a layer made itself (not its sublayers'), which its `call` reads, for keras_dist's split weights; private attribute."""
    return list(layer._trainable_variables)


def save_backup(backup: Any) -> None:
    """Saves a `BackupAndRestore` now, at the position it counts, which keras_dist does at the step every process agreed on; private method."""
    backup._save_model()


def save_method(callback: Any) -> Any:
    """A `ModelCheckpoint`'s or `BackupAndRestore`'s own save (`_save_model`, bound: the checkpoint's takes epoch, batch and logs, the backup's nothing), which keras_dist's atomic writes wrap; private method."""
    return callback._save_model


# What decides when a ModelCheckpoint or BackupAndRestore saves next, carried across fits.
_SAVE_SCHEDULE = ("_batches_seen_since_last_saving", "_last_batch_seen", "_current_epoch", "best")


def save_schedule(callback: Any) -> dict[str, Any]:
    """The counters that decide a checkpoint's or backup's next save (batches since the last save, the last batch, the epoch, the best value), which the chief's callback carries from one fit into the next, for the other processes' stand-ins made afresh at each fit; private attributes."""
    return {name: vars(callback)[name] for name in _SAVE_SCHEDULE if name in vars(callback)}


def callback_model(callback: Any) -> Any:
    """The model set on a callback (`_model`; None before `set_model`), without what the public `model` does first (JAX: sync the model's variables from its training state), for a copy of the callback with the same model; private attribute."""
    return vars(callback).get("_model")


def tensorboard_step_counter() -> str:
    """The name of the attribute where `TensorBoard` counts the batches it began (the step of its batch-level summaries), which keras_dist's resume saves and restores with other callbacks' counters; private attribute."""
    return "_global_train_batch"


# --- random seeds (keras.src.utils.rng_utils, keras.src.random.seed_generator) ----------------


def get_random_seed() -> int | None:
    """The seed a script gave `keras.utils.set_random_seed` (None without one), from which keras_dist draws its shuffles; Keras exports only the setter."""
    from keras.src.utils import rng_utils

    return rng_utils.get_random_seed()


def set_global_random_seed(seed: int) -> None:
    """Sets Keras's global seed and resets its global seed generator, as `set_random_seed` does but without seeding TensorFlow (keras_dist.startup shares the chief's seed); no public name."""
    from keras.src.backend.common import global_state
    from keras.src.random import seed_generator
    from keras.src.utils import rng_utils

    global_state.set_global_attribute(rng_utils.GLOBAL_RANDOM_SEED, seed)
    # A string before Keras 3.13 named it.
    global_state.set_global_attribute(getattr(seed_generator, "GLOBAL_SEED_GENERATOR", "global_seed_generator"), None)


# --- utilities --------------------------------------------------------------------------------


def is_default(method: Any) -> bool:
    """Whether a callback method is Callback's own (marked `@default`), which tells keras_dist which callbacks read batch logs; not public."""
    from keras.src.utils.python_utils import is_default as keras_is_default

    return keras_is_default(method)


def print_msg(message: str) -> None:
    """Prints as Keras's callbacks do (to absl logging when interactive logging is off), for LearningRateWarmup's message; not public."""
    from keras.src.utils import io_utils

    io_utils.print_msg(message)
