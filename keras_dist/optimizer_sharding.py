"""Optimizer state sharded across processes (`keras_dist.compile(..., shard="optimizer")`, ZeRO stage 1).

On PyTorch and under Horovod on TensorFlow (`shard_state`), every process keeps the whole
model and computes gradients for all of it, as in data parallel training; but each
variable has one owner process (`owners`: consecutive variables, about 1/N of the bytes
each), and only the owner builds the optimizer's state for it (Adam's two moments) and
updates it. The updated variables then travel from their owners to every other process.
Per process, the optimizer's state is about 1/N of an unsharded one's; the result is the
unsharded update's, since every owner applies it to the gradients reduced over all
processes.

The optimizer's `build` and `apply` are replaced on the object (no Keras class is
patched): `build` makes state for the owned variables alone, noting which variable and
slot each state variable is (`ShardedState`); `apply` reduces every gradient, applies the
owned ones with Keras's own `apply`, and hands the variables to `broadcast_from_owners`.
Clipping by global norm is done over every gradient first, so Keras's own, over the owned
ones, changes nothing more.

Saves write the unsharded optimizer's state, in its order, so a plain process loads them;
the unsharded order is that of the same optimizer class built on placeholder variables of
no size. A save gathers every process's share, a variable at a time as it is written (no
process holds the whole state at once), so every process takes part: the script's `save`
and `save_weights`, called on every process, are written by the chief alone while the
others take part in each variable's gather (`gathering_saves`); fit's checkpoints and
backups run on the chief while every other process runs a stand-in saving into scratch
(`CheckpointIO.collective_save_stand_in`), each gathering inside the optimizer's
`save_own_variables`. Loading takes each process's share
from a whole file; a backup the chief alone restores at fit's start reaches the others'
shares as the chief reads each value (`led_by_the_chief`; on JAX `ModelLeads`; on
PyTorch's split weights `SplitWeights`): the chief never holds the whole state. Where no
lead walks the restore, the chief notes the whole state and `share_loaded_state` sends it a
value at a time, each process keeping its share.

On JAX the state is sharded by layout instead (`shard_state_by_layout`): each slot the
optimizer makes is one array over the job's mesh, split along an axis of the variable
(Keras's `TensorLayout`, as `ModelParallel`'s layouts are), and XLA's step updates each
process's part and gathers the updated variables. Under `shard="weights"` the JAX strategy
splits the model's trainable weights the same way while fit runs; on PyTorch,
`keras_dist.strategies.torch_split_weights` splits every variable and its optimizer state
in flat slices.
"""

import contextlib
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import keras
import numpy as np

from keras_dist.errors import KerasDistError, PeerFailure
from keras_dist.overrides import methods_while, override

_STATE = "_keras_dist_sharded_state"


class ShardedState:
    """What a sharded optimizer knows of the whole: the variables it was built for, which of
    its own variables is which variable's slot, how every process's shares are gathered
    (`gather`: the unsharded state's values in its order, one at a time, on every process;
    each a collective, so every process iterates it whole, in step), the whole state it
    last loaded, and where each value of such a state goes on another process
    (`share_loaded_state`)."""

    def __init__(self, gather: Callable[[], Iterator[np.ndarray]], chief: bool, level: str = "optimizer") -> None:
        self.level = level  # "weights": the model's weights are split too (JAX, during fit)
        # Only the chief's loads are shared (`share_loaded_state`): only it notes them (not for
        # weights split for good, whose restore hands out each value as it is read).
        self.notes_loads = chief
        # In a checkpoint of fit the chief leads each variable's gather and the other
        # processes' stand-ins follow (`led_by_the_chief`): a stand-in gathers nothing itself.
        self.leading = False
        self.standing_in = False
        self.variables: list | None = None
        self.slots: dict[int, tuple[int, str]] = {}  # id(state variable) -> (variable index, slot name)
        self.gather = gather
        self.loaded: list[np.ndarray] | None = None
        # The chief's way to hand each value of a backup's restore to the others as it reads
        # it, where it leads the restore (`led_by_the_chief`): (layout key, whole value).
        self.hand_out: Callable[[tuple, np.ndarray], None] | None = None
        # On a process that did not load: from (position in the unsharded state, its value)
        # to this process's share of it (`share_loaded_state`).
        self.keep_loaded: Callable[[], Callable[[int, np.ndarray], None]] | None = None


def layout_of(optimizer_variables: Sequence[Any], slots: dict[int, tuple[int, str]]) -> list[tuple]:
    """Each of `optimizer_variables` as ("slot", variable index, slot name), or ("own", k) for
    the k-th that no variable's slot is (the iteration count, the learning rate)."""
    own = iter(range(len(optimizer_variables)))
    return [("slot", *slots[id(v)]) if id(v) in slots else ("own", next(own)) for v in optimizer_variables]


def recording_slots(add_from_reference: Callable[..., Any], index: dict[int, int],
                    slots: dict[int, tuple[int, str]]) -> Callable[..., Any]:
    """`add_variable_from_reference` that notes which variable and slot each one it makes is."""

    def add(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        created = add_from_reference(reference_variable, *args, **kwargs)
        slots[id(created)] = (index[id(reference_variable)], kwargs.get("name", args[0] if args else None))
        return created

    return add


def whole_layout(optimizer: keras.optimizers.Optimizer, state: ShardedState) -> list[tuple]:
    """The unsharded optimizer's variables, in its order (as `layout_of` gives them): the same
    class, from the same config, built on placeholders of no size for the variables."""
    shadow = type(optimizer).from_config(optimizer.get_config())
    placeholders = []
    for i, variable in enumerate(state.variables):
        placeholder = keras.Variable(np.zeros((0,), keras.backend.standardize_dtype(variable.dtype)),
                                     name=f"keras_dist_placeholder_{i}")
        if getattr(variable, "overwrite_with_gradient", False):
            placeholder.overwrite_with_gradient = True
        placeholders.append(placeholder)
    slots: dict[int, tuple[int, str]] = {}
    index = {id(p): i for i, p in enumerate(placeholders)}
    with methods_while(shadow, {"add_variable_from_reference": recording_slots(shadow.add_variable_from_reference,
                                                                               index, slots)}):
        shadow.build(placeholders)
    return layout_of(shadow.variables, slots)


def gather_whole_state(optimizer: keras.optimizers.Optimizer, replicas: Any) -> Iterator[np.ndarray]:
    """The unsharded optimizer's state in its order, one variable at a time, each sent by the
    process that owns it to every process (collective: every process iterates it whole).
    One variable at a time: no process holds the whole state at once."""
    state = sharded_state(optimizer)
    whole_value = _whole_values(optimizer, replicas)
    for key in whole_layout(optimizer, state):
        if state.standing_in:
            yield np.zeros((0,), "float32")
            continue
        if state.leading:
            replicas.collectives.broadcast_object(("state", key))
        yield whole_value(key)


def _whole_values(optimizer: keras.optimizers.Optimizer, replicas: Any) -> Callable[[tuple], np.ndarray]:
    """From a key in `whole_layout` to that variable of the unsharded optimizer's state, sent
    by the process that owns it (collective)."""
    state = sharded_state(optimizer)
    mine = dict(zip(layout_of(optimizer.variables, state.slots), optimizer.variables))
    owner = owners(state.variables, replicas.size)

    def whole_value(key: tuple) -> np.ndarray:
        if key[0] == "own":  # the iteration count and learning rate, the same everywhere
            return keras.ops.convert_to_numpy(mine[key].value)
        value = keras.ops.convert_to_numpy(mine[key].value) if replicas.rank == owner[key[1]] else None
        return replicas.collectives.broadcast_object(value, owner[key[1]])

    return whole_value


@contextlib.contextmanager
def led_by_the_chief(optimizer: keras.optimizers.Optimizer, replicas: Any) -> Iterator[None]:
    """A checkpoint of fit on the chief, whose stand-ins on every other process run at the
    same step (collective): the chief announces each variable's gather, and a stand-in's
    own save gathers nothing and then follows the chief's, so that their decisions to save
    (`save_best_only`, where their counters differ) cannot set them apart."""
    state = sharded_state(optimizer)
    state.leading, state.standing_in = replicas.is_chief, not replicas.is_chief
    try:
        yield
    finally:
        state.leading = state.standing_in = False
        if replicas.is_chief:
            replicas.collectives.broadcast_object(None)
        else:
            whole_value = _whole_values(optimizer, replicas)
            mine = dict(zip(layout_of(optimizer.variables, state.slots), optimizer.variables))
            while (request := replicas.collectives.broadcast_object(None)) is not None:
                if request[0] == "loaded state":  # a value of the chief's restore: kept where this process holds it
                    if request[1] in mine:
                        mine[request[1]].assign(request[2])
                else:
                    whole_value(request[1])


def checkpoints_led_by_the_chief(model: keras.Model, replicas: Any) -> contextlib.AbstractContextManager[None]:
    """The context of a checkpoint of fit (`CheckpointIO`'s `checkpoints_within`): led by the
    chief (`led_by_the_chief`) where `model`'s optimizer keeps a share of its state."""
    optimizer = getattr(model, "optimizer", None)
    state = sharded_state(optimizer) if optimizer is not None else None
    if state is not None and state.level == "optimizer" and state.variables is None and model.built:
        # A backup's restore at fit's start, before TensorFlow's fit builds the optimizer:
        # Keras's restore would build it on the chief alone, and the others could not keep
        # their shares of what it reads.
        with replicas.scope():
            optimizer.build(model.trainable_variables)
    if state is not None and state.level == "optimizer" and state.variables is not None:
        return led_by_the_chief(optimizer, replicas)
    return contextlib.nullcontext()


def attach_state(optimizer: keras.optimizers.Optimizer, state: ShardedState) -> None:
    """Marks `optimizer` as keeping its own share of the state, described by `state`."""
    override(optimizer, _STATE, state)


def sharded_state(optimizer: keras.optimizers.Optimizer) -> ShardedState | None:
    """The `ShardedState` of an optimizer `shard_state` sharded; None for any other."""
    return vars(optimizer).get(_STATE)


def gathering_saves(model: keras.Model, replicas: Any) -> None:
    """Makes `model.save` and `save_weights` (keras_dist's, written once from the chief) take
    part in gathering a sharded optimizer's state on every process: the chief's save gathers
    as it writes, and every other process takes part in each variable's gather before it
    waits for the chief's file."""
    for name in ("save", "save_weights"):
        def gathered(*args: Any, _save: Callable[..., Any] = getattr(model, name), method: str = name,
                     **kwargs: Any) -> Any:
            optimizer = model.optimizer
            state = sharded_state(optimizer) if optimizer is not None else None
            by_layer = replicas.checkpoint_io.saves_by_layer(model) if state is not None else None
            if state is None or (not optimizer.built and by_layer is None):
                return _save(*args, **kwargs)
            try:
                # Weights split for good: gathered a layer at a time as written (its optimizer built or not).
                if by_layer is not None:
                    _check_saved_by_layer(method, args[0] if args else kwargs.get("filepath"))
                    if not replicas.is_chief:
                        by_layer.follow()
                        return _save(*args, **kwargs)
                    with by_layer.leading_save():
                        return _save(*args, **kwargs)
                # In fit (a callback's save), the weights too, where they are split.
                with replicas.checkpoint_io.whole_weights(model):
                    if not replicas.is_chief:
                        for _ in state.gather():
                            pass
                    return _save(*args, **kwargs)
            except PeerFailure as failure:
                raise KerasDistError(f"model.{method} gathers every process's share of the optimizer's state, but "
                                     f"{', '.join(failure.stopped) or 'a peer'} did not take part: call it on every "
                                     "process (keras_dist writes the file once, from the chief), not on the chief "
                                     "alone") from None

        override(model, name, gathered)


def _check_saved_by_layer(method: str, filepath: Any) -> None:
    """One line where a save of a model split for good cannot gather it a layer at a time:
    into a file object (every process would write its own), or in Keras's legacy HDF5
    format (which reads each variable whole)."""
    if not isinstance(filepath, (str, os.PathLike)):
        raise KerasDistError(f"model.{method} of a model built in keras_dist.split_weights() writes to a path, from the "
                             "chief, not to a file object")
    if method == "save" and os.fspath(filepath).endswith((".h5", ".hdf5")):
        raise KerasDistError(f"model.save({os.fspath(filepath)!r}) would write the legacy HDF5 format, which reads a "
                             "model built in keras_dist.split_weights() whole: save to .keras, or save_weights to "
                             ".weights.h5")


def share_loaded_state(optimizer: keras.optimizers.Optimizer, replicas: Any) -> None:
    """Gives every process its share of the whole state the chief last loaded outside a
    restore it leads (a script's `load_weights` before fit, which may have run on the chief
    alone; a backup's restore hands out each value as it is read instead); collective:
    every process calls it. A value at a time, each let go once sent: no process receives
    the whole state."""
    state = sharded_state(optimizer)
    count = replicas.collectives.broadcast_object(None if state.loaded is None else len(state.loaded))
    if count is not None:
        keep = None if replicas.is_chief else state.keep_loaded()
        for position in range(count):
            value = replicas.collectives.broadcast_object(state.loaded[position] if replicas.is_chief else None)
            if replicas.is_chief:
                state.loaded[position] = None
            else:
                keep(position, value)
    state.loaded = None


def save_whole(state: ShardedState, store: Any) -> None:
    """Writes the unsharded state into `store` as it is gathered, a variable at a time (every
    process takes part: the chief's save, and the others' stand-ins into scratch, or their
    part in `gathering_saves`)."""
    for position, value in enumerate(state.gather()):
        store[str(position)] = value


def note_loaded(state: ShardedState, store: Any) -> None:
    if state.notes_loads:
        state.loaded = [np.asarray(store[str(position)]) for position in range(len(store.keys()))]


def check_level(shard: str, strategy: Any) -> None:
    """One line where `shard` is not a level, or not one this strategy (`Strategy`) shards."""
    if shard not in ("optimizer", "weights"):
        raise KerasDistError(f"shard must be None, 'optimizer' or 'weights', got {shard!r}")
    if strategy.size > 1 and not strategy.shards_optimizer_state:
        raise KerasDistError(f"backend {strategy.name!r} cannot shard the optimizer's state: run under Horovod "
                             "(keras-dist launch --backend horovod), on PyTorch or JAX (KERAS_BACKEND=torch or jax), "
                             "or drop shard (docs/sharding.md)")
    if shard == "weights" and strategy.size > 1 and not strategy.shards_weights:
        raise KerasDistError(f"backend {strategy.name!r} cannot shard the weights yet, only the optimizer's state: "
                             "use shard='optimizer', or run on JAX or PyTorch (KERAS_BACKEND=jax or torch)")


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
    if optimizer.built:
        raise KerasDistError("shard='optimizer' needs an optimizer not built yet, whose state it can split; this one "
                             "holds its whole state (load_model's): compile with a new optimizer, or drop shard")
    if optimizer.use_ema:
        raise KerasDistError("shard='optimizer' does not take use_ema=True yet (each process would average only its "
                             "own variables); drop one of them")


def is_sharded(optimizer: keras.optimizers.Optimizer) -> bool:
    """Whether `shard_state` made `optimizer` keep its own share of the state."""
    return sharded_state(optimizer) is not None


def shard_state(optimizer: keras.optimizers.Optimizer, replicas: Any,
                allreduce: Callable[[list], list], broadcast_from_owners: Callable[[list, list[int]], None]) -> None:
    """Makes `optimizer` keep state for, and update, the variables this process owns.

    Args:
        optimizer: a Keras 3 optimizer, not yet built (`keras_dist.compile` makes it).
        replicas: the job (`keras_dist.replicas.Replicas`): this process, the process count,
            and the gather of the shares for saves.
        allreduce: from a list of gradient tensors (no None) to the list reduced over processes.
        broadcast_from_owners: overwrites each variable everywhere with its owner's value
            (`variables`, and their owners' ranks).
    """
    if is_sharded(optimizer):
        return
    check_supported(optimizer)
    keras_build, keras_apply = optimizer.build, optimizer.apply
    rank, size = replicas.rank, replicas.size
    state = ShardedState(lambda: gather_whole_state(optimizer, replicas), replicas.is_chief)
    state.hand_out = lambda key, value: replicas.collectives.broadcast_object(("loaded state", key, value))
    placement: dict[tuple, list[int]] = {}

    def placed(variables: list) -> list[int]:
        key = tuple(id(v) for v in variables)
        if key not in placement:
            placement[key] = owners(variables, size)
        return placement[key]

    def build(variables: list) -> None:
        # Keras builds the optimizer from every trainable variable before the first step.
        state.variables = list(variables)
        index = {id(v): i for i, v in enumerate(state.variables)}
        recording = recording_slots(optimizer.add_variable_from_reference, index, state.slots)
        with methods_while(optimizer, {"add_variable_from_reference": recording}):
            keras_build([v for v, owner in zip(state.variables, placed(state.variables)) if owner == rank])

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
    save_and_load_whole(optimizer, state)
    attach_state(optimizer, state)


def save_and_load_whole(optimizer: keras.optimizers.Optimizer, state: ShardedState,
                        share_of: Callable[[Any, tuple, np.ndarray], Any] | None = None) -> None:
    """Makes `optimizer` save its state as the unsharded optimizer's (`save_whole`, a
    collective) and load this process's share of such a file, once built sharded (before,
    Keras's own methods).

    Args:
        optimizer: the sharded optimizer.
        state: its `ShardedState`.
        share_of: from (one of this process's optimizer variables, its layout key, the
            whole value in the file) to the value it takes; default: the whole value.
    """
    keras_save, keras_load = optimizer.save_own_variables, optimizer.load_own_variables

    def save_own_variables(store: Any) -> None:
        if state.variables is None:  # not built: nothing is sharded yet
            return keras_save(store)
        save_whole(state, store)

    def load_own_variables(store: Any) -> None:
        if state.variables is None:
            return keras_load(store)
        whole = whole_layout(optimizer, state)
        if len(store.keys()) != len(whole):
            raise KerasDistError(f"the file holds {len(store.keys())} optimizer variables, but this optimizer unsharded "
                                 f"has {len(whole)}: it was saved with another optimizer; compile with the file's")
        if state.leading and state.hand_out is not None:
            _hand_out_loaded(optimizer, state, store, whole)
            return
        position = {key: j for j, key in enumerate(whole)}
        for variable, key in zip(optimizer.variables, layout_of(optimizer.variables, state.slots)):
            value = np.asarray(store[str(position[key])])
            variable.assign(value if share_of is None else share_of(variable, key, value))
        note_loaded(state, store)

    def keep_loaded() -> Callable[[int, np.ndarray], None]:
        mine = dict(zip(layout_of(optimizer.variables, state.slots), optimizer.variables))
        whole = whole_layout(optimizer, state)

        def keep(position: int, value: np.ndarray) -> None:
            variable = mine.get(whole[position])
            if variable is not None:
                variable.assign(value if share_of is None else share_of(variable, whole[position], value))
        return keep

    override(optimizer, "save_own_variables", save_own_variables)
    override(optimizer, "load_own_variables", load_own_variables)
    state.keep_loaded = keep_loaded


def _hand_out_loaded(optimizer: keras.optimizers.Optimizer, state: ShardedState, store: Any,
                     whole: list[tuple]) -> None:
    """The chief's restore of a backup at fit's start, which it leads (`led_by_the_chief`):
    each value of the unsharded state, in the file's order, kept where the chief holds it
    and handed to the others as it is read, so that the chief never holds the whole state
    (each other process keeps what it owns)."""
    mine = dict(zip(layout_of(optimizer.variables, state.slots), optimizer.variables))
    for position, key in enumerate(whole):
        value = np.asarray(store[str(position)])
        if key in mine:
            mine[key].assign(value)
        state.hand_out(key, value)
    state.loaded = None  # an earlier load's note (a script's load_weights) must not overwrite it


def shard_state_by_layout(optimizer: keras.optimizers.Optimizer, chief: bool, layout_for: Callable[[tuple], Any],
                          whole_values: Callable[[list], Iterator[np.ndarray]],
                          place: Callable[[Any, np.ndarray], None], level: str = "optimizer",
                          hand_out: Callable[[list, int, np.ndarray], bool] = lambda *loaded: False) -> None:
    """Makes every slot `optimizer` builds one array split over the job's mesh (JAX).

    Args:
        optimizer: a Keras 3 optimizer, not yet built.
        chief: this process is the job's chief.
        layout_for: from a slot's shape to its sharded `TensorLayout`, or None where no axis
            divides among the devices (the slot then keeps the layout Keras gives it).
        whole_values: the variables' whole values, one at a time (collective: every process
            iterates it; raises `PeerFailure` where one does not).
        place: sets a variable to a whole value, each process keeping its part (no collective).
        level: "optimizer", or "weights" where the strategy splits the model's weights too.
        hand_out: in a backup's restore, the chief's alone, hands each whole value read (the
            optimizer's variables, a position, the value) to the others as it is read, and
            returns True; False where it does not (the chief then notes the whole state,
            `share_loaded_state`).
    """
    if is_sharded(optimizer):
        return
    check_supported(optimizer)
    keras_add, keras_save, keras_load = optimizer.add_variable, optimizer.save_own_variables, \
        optimizer.load_own_variables

    state = ShardedState(lambda: whole_values(optimizer.variables), chief, level)

    def add_variable(*args: Any, layout: Any = None, **kwargs: Any) -> Any:
        shape = kwargs.get("shape", args[0] if args else ())
        return keras_add(*args, layout=layout_for(tuple(shape)) or layout, **kwargs)

    def save_own_variables(store: Any) -> None:
        if not optimizer.built:
            return keras_save(store)
        save_whole(state, store)

    def load_own_variables(store: Any) -> None:
        if not optimizer.built:
            return keras_load(store)
        if len(store.keys()) != len(optimizer.variables):
            raise KerasDistError(f"the file holds {len(store.keys())} optimizer variables, but this optimizer has "
                                 f"{len(optimizer.variables)}: it was saved with another optimizer; compile with the "
                                 "file's")
        handed_out = False
        for position, variable in enumerate(optimizer.variables):
            whole = np.asarray(store[str(position)])
            place(variable, whole)
            handed_out = hand_out(optimizer.variables, position, whole)
        if handed_out:
            state.loaded = None  # an earlier load's note (a script's load_weights) must not overwrite it
        else:
            note_loaded(state, store)

    override(optimizer, "add_variable", add_variable)
    override(optimizer, "save_own_variables", save_own_variables)
    override(optimizer, "load_own_variables", load_own_variables)
    state.keep_loaded = lambda: lambda position, value: place(optimizer.variables[position], value)
    attach_state(optimizer, state)


def _clip_by_global_norm(grads: list, clip_norm: float) -> list:
    """`grads` scaled so that their joint norm is at most `clip_norm`, as Keras clips them."""
    present = [g for g in grads if g is not None]
    norm = keras.ops.sqrt(sum(keras.ops.sum(keras.ops.square(g)) for g in present))
    scale = keras.ops.minimum(1.0, clip_norm / keras.ops.maximum(norm, 1e-12))
    return [None if g is None else g * keras.ops.cast(scale, g.dtype) for g in grads]
