"""The one home of input: what each process reads for `fit`, its validation, `evaluate` and `predict`.

Keras routes a call's input from its trainer through a data adapter to the distribution;
keras_dist splits it once, before that route starts, by one rule for every kind Keras
accepts: element i goes to replica i mod N, the batch size stays per replica, training
shards are padded so every replica runs the same number of steps, and evaluation and
prediction shards are not (every example counts once). Element i is the i-th of the
epoch's order: where `fit` shuffles, keras_dist draws one permutation of the whole input
per epoch (from the job's seed and the epoch, as `DistributedSampler.set_epoch`) and
splits that, so each replica's batches are a uniform sample of the data set, different
every epoch, never a fixed stride of it (docs/semantics.md). Each kind has its module, and
only the module of a kind imports its framework:

* arrays (NumPy, or anything with `__array__`): `keras_dist.inputs.arrays`;
* `tf.data.Dataset`: `keras_dist.inputs.tf_data` (rewrites the pipeline so each process
  reads and preprocesses only its share);
* `keras.utils.PyDataset`: `keras_dist.inputs.py_dataset`;
* torch `DataLoader`: `keras_dist.inputs.data_loader` (as `DistributedSampler` splits);
* Python generators: `keras_dist.inputs.generators` (every N-th batch of the stream).

Every kind's module has its `InputKind` (`keras_dist.inputs.base`: split, order for resume,
gather predictions), and `KINDS` tells the kinds apart: a new kind is one module and one
line there. A strategy says how its process reads as data (`Replicas.input_plan`).
"""

import dataclasses
import sys
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import keras

from keras_dist.errors import KerasDistError
from keras_dist.inputs import arrays
from keras_dist.inputs.base import InputKind, Inputs, job_seed  # noqa: F401 (the package's interface)
from keras_dist.inputs.position import EpochPosition

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas


def is_tf_dataset(data: Any) -> bool:
    """Whether `data` is a `tf.data.Dataset` (without importing TensorFlow: none exists before it is)."""
    tf = sys.modules.get("tensorflow")
    return tf is not None and isinstance(data, tf.data.Dataset)


def is_data_loader(data: Any) -> bool:
    """Whether `data` is a `torch.utils.data.DataLoader` (without importing torch)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(data, torch.utils.data.DataLoader)


def _tf_data() -> InputKind:
    from keras_dist.inputs.tf_data import TFDataKind

    return TFDataKind()


def _py_dataset() -> InputKind:
    from keras_dist.inputs.py_dataset import PyDatasetKind

    return PyDatasetKind()


def _data_loader() -> InputKind:
    from keras_dist.inputs.data_loader import DataLoaderKind

    return DataLoaderKind()


def _generator() -> InputKind:
    from keras_dist.inputs.generators import GeneratorKind

    return GeneratorKind()


@dataclasses.dataclass(frozen=True)
class Kind:
    """One kind of input Keras accepts: how to tell it without importing its framework, and
    how to make its `InputKind` (importing its module, once its framework exists)."""

    recognises: Callable[[Any], bool]
    make: Callable[[], InputKind]


# Every kind, in the order they are told apart: a new kind is a module and a line here.
KINDS = (
    Kind(is_tf_dataset, _tf_data),
    Kind(lambda x: isinstance(x, keras.utils.PyDataset), _py_dataset),
    Kind(is_data_loader, _data_loader),
    Kind(lambda x: x is not None and arrays.is_array_input(x), arrays.ArraysKind),
    Kind(lambda x: isinstance(x, types.GeneratorType), _generator),
)


def kind_of(x: Any) -> InputKind | None:
    """`x`'s kind (its module imported now: its framework is, since `x` exists), or None."""
    return next((k.make() for k in KINDS if k.recognises(x)), None)


def fit(replicas: "Replicas", data: Inputs, validation_data: Any = None, validation_split: float = 0.0,
        validation_batch_size: int | None = None, validation_steps: int | None = None,
        position: EpochPosition | None = None, shuffle: bool | str = False) -> tuple[Inputs, Inputs | None]:
    """This process's training input (padded to equal steps) and validation input (None: none).

    With `position` (a fit that may resume inside an epoch, `keras_dist.fault_tolerance.resume`,
    or that several processes run), inputs whose order keras_dist can draw (arrays that
    `shuffle`, any in an elastic job, a PyDataset of known length, a DataLoader it splits)
    are ordered by it, one global permutation per shuffled epoch, and start an epoch
    resumed after the part done themselves (`Inputs.ordered`, `EpochPosition.sources_skip`),
    on any process count (`EpochPosition.resizable`).
    """
    if validation_split and validation_data is None and arrays.is_array_input(data.x):
        data, validation_data = _hold_out(data, validation_split)
    validation = None
    if validation_data is not None:
        held = Inputs.of_validation(validation_data, validation_batch_size or data.batch_size, validation_steps)
        validation = _split(replicas, held, pad=False, purpose="validation")
    ordered = _ordered(replicas, data, position, shuffle) if position is not None and data.steps is None else None
    return ordered or _split(replicas, data, pad=True, purpose="fit"), validation


def evaluate(replicas: "Replicas", data: Inputs) -> Inputs:
    """This process's share of `evaluate`'s input (not padded)."""
    return _split(replicas, data, pad=False, purpose="evaluate")


def predict(replicas: "Replicas", data: Inputs) -> Inputs:
    """This process's share of `predict`'s input (files never split, to keep the order).

    Arrays are padded to equal shards, so that no process runs Keras's loop on nothing
    (fewer samples than processes) and steps end together; the gather drops the padding.
    Other kinds give an empty share a stand-in batch (`Inputs.stand_in`).
    """
    return _split(replicas, data, pad=False, purpose="predict")


def gather_predictions(replicas: "Replicas", data: Inputs, outputs: Any) -> Any:
    """Every process's `predict` outputs for the split `data`, in the script's input order."""
    if replicas.input_plan.num_shards == 1:
        return outputs
    return data.kind.gather(replicas, data, outputs)


def dataset_share(replicas: "Replicas", dataset: Any, training: bool) -> Any:
    """This process's share of a batched `tf.data.Dataset`, whole batches per replica, for
    loops of the script's own (`keras_dist.distribute_dataset`); `training` pads the shards
    to equal length, as `fit` does."""
    from keras_dist.inputs import tf_data

    plan = replicas.input_plan
    share, _ = tf_data.shard_dataset(dataset, plan.num_shards, plan.shard_index, training, plan.batch_multiplier,
                                     allgather=replicas.collectives.allgather_object)
    return share


def as_validation_data(validation: Inputs) -> Any:
    """What `fit` takes as `validation_data`, for the split `validation`."""
    is_arrays = arrays.is_array_input(validation.x)
    return (validation.x, validation.y, validation.sample_weight) if is_arrays else validation.x


def _hold_out(data: Inputs, fraction: float) -> tuple[Inputs, tuple]:
    """Keras's `validation_split`, taken before the split as one process would: the last fraction."""
    kept, held = arrays.hold_out((data.x, data.y, data.sample_weight), fraction)
    return dataclasses.replace(data, x=kept[0], y=kept[1], sample_weight=kept[2]), held


def _ordered(replicas: "Replicas", data: Inputs, position: EpochPosition, shuffle: bool | str) -> Inputs | None:
    """This process's training share of `data`, ordered by keras_dist (a fit that may resume
    inside an epoch, or that several processes run): each epoch that `fit` shuffles is one
    permutation of the whole input, drawn from the job's seed and the epoch, split
    interleaved; None where keras_dist cannot order it (`_split` splits it then)."""
    kind = kind_of(data.x)
    share = kind.ordered(replicas, data, position, shuffle) if kind is not None else None
    return None if share is None else dataclasses.replace(share, kind=kind)


def _split(replicas: "Replicas", data: Inputs, pad: bool, purpose: str) -> Inputs:
    """This process's share of `data`, as the strategy then takes it (its kind's `split`)."""
    kind = kind_of(data.x)
    if kind is not None:
        return dataclasses.replace(kind.split(replicas, data, pad, purpose), kind=kind)
    if replicas.input_plan.num_shards > 1:
        raise KerasDistError(
            f"keras_dist cannot split a {type(data.x).__name__} across {replicas.input_plan.num_shards} processes; "
            "pass NumPy arrays, a tf.data.Dataset, a keras.utils.PyDataset or a torch DataLoader"
        )
    return data
