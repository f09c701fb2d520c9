"""The model's trainable weights split over PyTorch processes while `fit` runs
(`keras_dist.compile(..., shard="weights")`, ZeRO stage 3).

Each trainable variable is cut, flat and padded, into N equal slices; process r keeps
slice r as a variable of its own (`SplitWeights.slices`), and the optimizer is built on
those slices alone (Keras's own update rule on each process's part: Adam's state 1/N).
While `fit` runs, the storage of the model's own variables is released, so each process
holds 1/N of the weights, 1/N of their gradients and 1/N of the optimizer's state:

- forward: each layer that owns trainable variables gathers them whole as its `call`
  starts (one all-gather of the layer's slices) and releases them as it ends;
- backward: a hook on the layer's outputs gathers them again before the layer's own
  gradients are computed; as each variable's gradient is complete, a hook releases
  the variable, and once all of a layer's are, one reduce-scatter turns them into this
  process's slices of the averaged gradients;
- update: the optimizer applies the slices' gradients to the slices.

Torch's autograd keeps the variable (a `Parameter`) itself for the backward pass, not a
copy: releasing and gathering replace its data (`Parameter.data`), which autograd allows
and does not count as a change of the tensor it saved.

Variables read outside their layer's `call` stay whole: those with a regularizer (Keras
computes the penalty from the variable after the forward pass), and any no layer owns.
Their update is still split (each process updates its slice; the slices are gathered
after each step). At fit's end (and around each checkpoint the chief writes in `fit`)
every variable is gathered whole again, so `evaluate`, `predict`, saves and the script's
own code see the unsharded model. The optimizer's state stays split; saves write it
whole, in the unsharded optimizer's order (`optimizer_sharding.whole_layout`).

A model built in `keras_dist.split_weights` (`torch_split_creation`) never is whole: it is
split at its compile and stays split (`split_for_good`). The script's saves then gather
one layer's variables at a time as Keras writes them, on the chief, each gather announced
to the others (`leading_save`, `follow`); fit's checkpoints likewise, the chief leading
and every other process's stand-in following (`checkpoint_together`), written at their
step (no host copy of the whole state). Outside fit every call of the model gathers its
layers' weights (a collective: every process calls it). A load gives each layer's variables room
for the whole values Keras reads and keeps this process's slices (`room_for_load`); a
backup's restore, the chief's alone, hands each value it reads to the others.
"""

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_dist import keras_internals, optimizer_sharding
from keras_dist.errors import KerasDistError
from keras_dist.split_creation import SLICE
from keras_dist.strategies.chief_leads import ChiefLeads
from keras_dist.strategies.torch_split_creation import flat_slice, slice_length
from keras_dist.overrides import is_overridden, methods_while, override

if TYPE_CHECKING:
    import torch

    from keras_dist.collectives import Collectives

# On a layer: the `SplitWeights` its `call` gathers from, or None (the weights are whole).
_SPLIT = "_keras_dist_split_weights"




class SplitWeights(ChiefLeads):
    """One model's trainable variables split over the job's processes, with the optimizer
    that trains their slices.

    Args:
        collectives: the job's torch collectives (torch.distributed's or Horovod's), with
            their `all_gather_` and `reduce_scatter_`.
        optimizer: the model's optimizer, not yet built; it is made to build and update
            the slices (`keras_dist.compile` calls this for `shard="weights"`).
        in_train_step: whether a train step runs now (only its backward passes reduce).
    """

    def __init__(self, collectives: "Collectives", optimizer: keras.optimizers.Optimizer,
                 in_train_step: Callable[[], bool]) -> None:
        import torch

        super().__init__(collectives)
        self._torch = torch
        self.in_train_step = in_train_step
        self.rank, self.size = collectives.rank, collectives.size
        self.optimizer = optimizer
        self.variables: list[keras.Variable] = []  # the model's, as the optimizer was built on them
        self.index: dict[int, int] = {}  # id(variable) -> its position in `variables`
        self.slices: dict[int, keras.Variable] = {}  # id(variable) -> this process's slice of it
        self.kept_whole: set[int] = set()  # ids of variables read outside their layer's call
        self.released: set[int] = set()  # ids of variables whose data is released now
        self.gradients: dict[int, "torch.Tensor"] = {}  # id(variable) -> this step's reduced slice
        self.units: dict[int, list[keras.Variable]] = {}  # id(layer) -> the split variables it reads
        self.unit_key: dict[int, int] = {}  # id(split variable) -> id(its layer)
        self.pending: dict[int, list] = {}  # id(layer) -> its (variable, gradient)s complete, not yet reduced
        self.active = False  # the variables are split (inside fit)
        self.for_good = False  # split from their creation (`keras_dist.split_weights`): they stay split
        self._whole_depth = 0  # nested `whole` blocks: the outermost gathers and releases
        self._hooks: list = []
        self.state = optimizer_sharding.ShardedState(self._gather_whole_state, collectives.rank == 0, "weights")
        self._shard_optimizer()

    # --- the optimizer, on the slices ------------------------------------------------
    def _shard_optimizer(self) -> None:
        """Replaces, on the optimizer object, what must see slices instead of whole variables."""
        optimizer = self.optimizer
        _check_splittable(optimizer)
        override(optimizer, "build", functools.partial(self._build_on_slices, optimizer.build))
        override(optimizer, "apply", functools.partial(self._apply_to_slices, optimizer.apply))
        optimizer_sharding.save_and_load_whole(optimizer, self.state, self._my_share_of_loaded)
        optimizer_sharding.attach_state(optimizer, self.state)

    def _build_on_slices(self, keras_build: Callable[[list], None], variables: list) -> None:
        """The optimizer's `build`: its slots made for this process's slices of `variables`."""
        for variable in variables:
            if variable.constraint is not None or getattr(variable, "overwrite_with_gradient", False):
                raise KerasDistError(f"shard='weights' cannot split {variable.path}: its constraint (or float8 "
                                     "scale) applies to the whole variable; use shard='optimizer'")
        state = self.state
        state.variables = list(variables)
        self.variables = state.variables
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        for variable in self.variables:
            created = vars(variable).get(SLICE)
            part = self._my_slice_of(variable) if created is None else created.detach().clone()
            self.slices[id(variable)] = keras.Variable(part, dtype=variable.dtype,
                                                       name=f"keras_dist_slice_of_{variable.path.replace('/', '_')}")
            if created is not None or self.for_good:  # its one home now (a later compile's SplitWeights reads it)
                setattr(variable, SLICE, _parameter(self.slices[id(variable)]))
            if tuple(_parameter(variable).shape) != tuple(variable.shape):
                self.released.add(id(variable))
        slices = [self.slices[id(v)] for v in self.variables]
        index = {id(s): i for i, s in enumerate(slices)}
        recording = optimizer_sharding.recording_slots(self.optimizer.add_variable_from_reference, index, state.slots)
        with methods_while(self.optimizer, {"add_variable_from_reference": recording}):
            keras_build(slices)

    def _apply_to_slices(self, keras_apply: Callable[..., None], grads: list, trainable_variables: Any = None) -> None:
        """The optimizer's `apply`: this process's reduced gradient slices applied to its weight
        slices, then the whole weights gathered back where the step needs them."""
        optimizer = self.optimizer
        variables = list(trainable_variables) if trainable_variables is not None else self.variables
        for unit in [unit for unit in self.units if unit in self.pending]:  # layers some gradient missed
            self._reduce_pending(unit)
        pairs = []
        for variable, grad in zip(variables, grads):
            reduced = self.gradients.pop(id(variable), None)
            if reduced is None and grad is not None:  # whole (a step outside fit): its slice as it is now
                reduced = self._reduced_slice(variable, grad)
                self.slices[id(variable)].assign(self._my_slice_of(variable))
            if reduced is not None:
                pairs.append((reduced, self.slices[id(variable)]))
        if optimizer.global_clipnorm and pairs:
            pairs = list(zip(self._clipped([g for g, _ in pairs], optimizer.global_clipnorm), [s for _, s in pairs]))
        if pairs:
            keras_apply([g for g, _ in pairs], [s for _, s in pairs])
        else:
            optimizer.iterations.assign_add(1)
        if self.active:  # also those the step gathered and no gradient reached (never released)
            self.release([v for v in self.variables if id(v) not in self.released and id(v) not in self.kept_whole])
        self.gather([v for v in self.variables if not self.active or id(v) in self.kept_whole], refresh=True)

    def _my_share_of_loaded(self, mine: keras.Variable, key: tuple, whole: np.ndarray) -> np.ndarray:
        """What this process's optimizer variable `mine` takes of a whole one read from a file:
        its slice of a slot, all of the rest (the iteration count). In a backup's restore of a
        model split for good, the chief hands each value it read to the others."""
        if self.leading:  # a backup's restore, the chief's alone
            self.announce(("loaded state", key))
            self.collectives.broadcast_object(whole)
        return self._my_share_of_array(whole, int(np.prod(mine.shape))) if key[0] == "slot" else whole

    def _my_share_of_array(self, whole: np.ndarray, length: int) -> np.ndarray:
        """This process's slice of `length` of a whole value read from a file."""
        flat = np.zeros((length * self.size,), whole.dtype)
        flat[:whole.size] = whole.reshape(-1)
        return flat[self.rank * length:(self.rank + 1) * length]

    def _gather_whole_state(self) -> Iterator[np.ndarray]:
        """The unsharded optimizer's state in its order, a variable at a time (collective; in a
        save the chief leads, each variable's gather announced; a stand-in gathers nothing)."""
        mine = self._state_by_key()
        for key in optimizer_sharding.whole_layout(self.optimizer, self.state):
            if self.standing_in:
                yield np.zeros((0,), "float32")
                continue
            if self.leading:
                self.announce(("state", key))
            yield self._gathered_state(key, mine[key])

    def _state_by_key(self) -> dict[tuple, keras.Variable]:
        """This process's optimizer variables by their key in `optimizer_sharding.whole_layout`."""
        variables = self.optimizer.variables
        return dict(zip(optimizer_sharding.layout_of(variables, self.state.slots), variables))

    def _gathered_state(self, key: tuple, mine: keras.Variable) -> np.ndarray:
        """One variable of the unsharded optimizer's state, by its key in `whole_layout`, from
        this process's `mine` (collective)."""
        state = self.state
        value = _parameter(mine)  # not `.value`: inside a layer's call Keras casts it to the compute dtype
        if key[0] == "own":
            return keras.ops.convert_to_numpy(value)
        variable = state.variables[key[1]]
        whole = self._all_gathered(value.detach(), f"state.{key[1]}.{key[2]}")
        return whole[:int(np.prod(variable.shape))].reshape(variable.shape).cpu().numpy()

    def _clipped(self, grads: list, clip_norm: float) -> list:
        """The slices' gradients scaled so that the whole gradients' joint norm is at most `clip_norm`."""
        torch = self._torch
        squares = torch.stack([torch.sum(torch.square(g.float())) for g in grads]).sum().reshape(1)
        squares = self.collectives.wait(self.collectives.start_sum(squares.to(self.collectives.device),
                                                                   "keras_dist.split_weights.norm"), squares)
        scale = torch.clamp(clip_norm / torch.clamp(torch.sqrt(squares), min=1e-12), max=1.0).to(grads[0].device)
        return [g * scale.to(g.dtype) for g in grads]

    # --- the model's variables ------------------------------------------------------
    def split(self, model: keras.Model) -> None:
        """Takes each process's slice of the (whole, equal) variables and releases their data;
        installs the layers' gathers and the gradients' reductions (at fit's start)."""
        if not self.variables or self.active:
            return
        if model.jit_compile:
            raise KerasDistError("shard='weights' replaces each variable's data around each layer's call, which a "
                                 "compiled step (jit_compile=True) does not see: compile with jit_compile=False")
        owned = _reading_layers(model)
        self.kept_whole = {id(v) for v in self.variables if v.regularizer is not None or id(v) not in owned}
        self.units, self.unit_key = {}, {}
        for variable in self.variables:
            if id(variable) not in self.kept_whole:
                self.units.setdefault(id(owned[id(variable)]), []).append(variable)
                self.unit_key[id(variable)] = id(owned[id(variable)])
        for layer in {id(layer): layer for layer in owned.values()}.values():
            _gathering_call(layer, self._torch)
            object.__setattr__(layer, _SPLIT, self)
        for layer in keras_internals.flatten_layers(model):
            if any(id(v) in self.index for v in keras_internals.own_trainable_variables(layer)):
                _saved_in_parts(layer)
                object.__setattr__(layer, _SPLIT, self)
        with self._torch.no_grad():
            for variable in self.variables:
                if id(variable) not in self.released:  # whole now: its slice as it is (split at creation: kept)
                    self.slices[id(variable)].assign(self._my_slice_of(variable))
        self._hooks = [_parameter(v).register_post_accumulate_grad_hook(self._gradient_ready(v))
                       for v in self.variables]
        for name in ("get_weights", "set_weights"):  # every process calls them alike (EarlyStopping)
            if not is_overridden(model, name):
                override(model, name, self._whole_while(getattr(model, name)))
        self.active = True
        self.release([v for v in self.variables if id(v) not in self.kept_whole])
        self.gather([v for v in self.variables if id(v) in self.kept_whole])  # those split at creation

    def split_for_good(self, model: keras.Model) -> None:
        """Splits a model built in `keras_dist.split_weights` at its compile, for good: its
        optimizer is built on the slices there, and `join` is never called for it but at
        the next compile (collective)."""
        self.for_good = True
        self.state.notes_loads = False  # a load is every process's, a restore hands out what it reads (`follow`)
        if not self.optimizer.built:
            self.optimizer.build(model.trainable_variables)
        # Those built split and not trained (frozen before this compile): whole for good.
        for variable in model.weights:
            if SLICE in vars(variable) and id(variable) not in self.index:
                part = vars(variable).pop(SLICE).detach()
                everyone = self._all_gathered(part, f"frozen.{variable.path}")
                _parameter(variable).data = everyone[:int(np.prod(variable.shape))].reshape(tuple(variable.shape))
        self.split(model)

    def join(self, gather: bool = True) -> None:
        """Gathers every variable whole again, for good (at fit's end); without `gather` (fit
        failed: a peer may be gone) the released variables stay empty."""
        if not self.active:
            return
        if gather:
            self.gather(self.variables)
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self.gradients.clear()
        self.pending.clear()
        self.active = False

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every variable whole for the duration (evaluation, a checkpoint or the model's
        `get_weights` and `set_weights` in fit; collective); what was assigned meanwhile
        (`set_weights`: `EarlyStopping` restoring the best weights) reaches the slices."""
        if not self.active or self._whole_depth or self.leading or self.standing_in:  # a layer at a time
            yield
            return
        self.gather(self.variables)
        self._whole_depth += 1
        try:
            yield
        finally:
            self._whole_depth -= 1
            with self._torch.no_grad():
                for variable in self.variables:
                    _parameter(self.slices[id(variable)]).copy_(self._my_slice_of(variable))
            self.release([v for v in self.variables if id(v) not in self.kept_whole])

    def _whole_while(self, method: Any) -> Any:
        def whole_method(*args: Any, **kwargs: Any) -> Any:
            with self.whole():
                return method(*args, **kwargs)

        return whole_method

    # --- saves and loads of a model split for good, a layer at a time -----------------------
    # The chief leads, announcing each gather, and the others follow (`ChiefLeads.follow`): in
    # the script's saves (`leading_save`) and in fit's checkpoints (`checkpoint_together`),
    # where a backup's restore at fit's start is the chief's alone and it hands out what it reads.
    def part_taker(self) -> Callable[[str, Any], None]:
        mine = self._state_by_key()

        def take_part(kind: str, detail: Any) -> None:
            if kind == "state":
                self._gathered_state(detail, mine[detail])
            elif kind == "weights":
                self.release(self.gather([self.variables[i] for i in detail]))
            elif kind == "loaded weights":
                self._take_loaded([self.variables[i] for i in detail])
            else:  # "loaded state": one optimizer variable's whole value
                whole = self.collectives.broadcast_object(None)
                mine[detail].assign(self._my_share_of_loaded(mine[detail], detail, whole))

        return take_part

    @contextlib.contextmanager
    def gathered_for_save(self, variables: list) -> Iterator[None]:
        """`variables` (one layer's) whole while Keras writes them, in the chief's save or in
        a checkpoint every process writes."""
        wanted = [v for v in variables if id(v) in self.released]
        if not wanted or self.standing_in:
            yield
            return
        if not self.leading:
            raise KerasDistError(f"{wanted[0].path} is split over the job's processes (keras_dist.split_weights): save "
                                 "the model keras_dist.compile compiled, with model.save or model.save_weights called "
                                 "on every process")
        self.announce(("weights", [self.index[id(v)] for v in wanted]))
        gathered = self.gather(wanted)
        try:
            yield
        finally:
            self.release(gathered)

    @contextlib.contextmanager
    def room_for_load(self, variables: list) -> Iterator[None]:
        """Room for `variables` (one layer's) whole while Keras reads them from a file; each
        then keeps its slice of what was read (no collective where every process reads the
        file; in a backup's restore the chief hands each value to the others)."""
        torch = self._torch
        wanted = [v for v in variables if id(v) in self.index]
        released = [v for v in wanted if id(v) in self.released]
        for variable in released:
            parameter = _parameter(variable)
            parameter.data = torch.empty(tuple(variable.shape), dtype=parameter.dtype, device=parameter.device)
        try:
            yield
        except BaseException:
            self.release(released)
            raise
        if self.leading and wanted:  # a backup's restore, the chief's alone
            self.announce(("loaded weights", [self.index[id(v)] for v in wanted]))
            for variable in wanted:
                self.collectives.broadcast_(_parameter(variable).detach().to(self.collectives.device), 0)
        with torch.no_grad():
            for variable in wanted:
                _parameter(self.slices[id(variable)]).copy_(self._my_slice_of(variable))
        self.release(released)

    def _take_loaded(self, variables: list) -> None:
        """This process's slices of the values the chief's restore read (`room_for_load`)."""
        torch = self._torch
        for variable in variables:
            parameter = _parameter(variable)
            whole = torch.empty(tuple(variable.shape), dtype=parameter.dtype, device=self.collectives.device)
            self.collectives.broadcast_(whole, 0)
            whole = whole.to(parameter.device)
            with torch.no_grad():
                _parameter(self.slices[id(variable)]).copy_(flat_slice(torch, whole, self.rank, self.size))
                if id(variable) not in self.released:  # held whole (read outside its layer's call)
                    parameter.copy_(whole)

    def unit_of(self, layer: Any) -> list[keras.Variable]:
        return self.units.get(id(layer), []) if self.active else []

    def gather(self, variables: list, refresh: bool = False) -> list:
        """Makes `variables` whole from every process's slice, in one all-gather per dtype
        (collective: every process asks for the same ones); with `refresh`, also those held
        whole already. Returns those it gathered."""
        torch = self._torch
        wanted = [v for v in variables if refresh or id(v) in self.released]
        for dtype in sorted({_parameter(v).dtype for v in wanted}, key=str):
            group = [v for v in wanted if _parameter(v).dtype == dtype]
            lengths = [len(_parameter(self.slices[id(v)])) for v in group]
            mine = torch.cat([_parameter(self.slices[id(v)]).detach().reshape(-1) for v in group])
            everyone = self._all_gathered(mine, f"weights.{self.index[id(group[0])]}.{len(group)}").view(self.size, -1)
            start = 0
            for variable, length in zip(group, lengths):
                count = int(np.prod(variable.shape))
                # One process's slice after another: a copy where the group holds several variables.
                whole = everyone[:, start:start + length].reshape(-1)[:count].reshape(tuple(variable.shape))
                _parameter(variable).data = whole
                start += length
                self.released.discard(id(variable))
        return wanted

    def release(self, variables: list) -> None:
        """Drops the whole data of `variables` (their slices stay); no collective."""
        for variable in variables:
            parameter = _parameter(variable)
            parameter.data = self._torch.empty((0,), dtype=parameter.dtype, device=parameter.device)
            self.released.add(id(variable))

    def _my_slice_of(self, variable: keras.Variable) -> "torch.Tensor":
        """This process's slice of the whole `variable` (flat, padded with zeros)."""
        return flat_slice(self._torch, _parameter(variable).detach(), self.rank, self.size)

    def _all_gathered(self, part: "torch.Tensor", name: str) -> "torch.Tensor":
        device = self.collectives.device
        out = self._torch.empty((part.numel() * self.size,), dtype=part.dtype, device=device)
        self.collectives.all_gather_(out, part.to(device).contiguous(), f"keras_dist.split_weights.{name}")
        return out.to(part.device)

    def _reduced_slice(self, variable: keras.Variable, grad: "torch.Tensor") -> "torch.Tensor":
        """This process's slice of `grad` averaged over processes (collective)."""
        return self._reduced_slices([(variable, grad)])[0]

    def _reduced_slices(self, pairs: list) -> list:
        """This process's slice of each gradient of `pairs` ((variable, gradient), one dtype)
        averaged over processes, in one reduce-scatter (collective)."""
        torch = self._torch
        device = self.collectives.device
        lengths = [_slice_length(variable, self.size) for variable, _ in pairs]
        # Rank-major: process r's slices of every gradient, one after another.
        flat = torch.zeros((self.size, sum(lengths)), dtype=pairs[0][1].dtype, device=device)
        start = 0
        for (variable, grad), length in zip(pairs, lengths):
            padded = torch.zeros((self.size * length,), dtype=grad.dtype, device=device)
            padded[:grad.numel()] = grad.detach().reshape(-1)
            flat[:, start:start + length] = padded.view(self.size, length)
            start += length
        out = torch.empty((sum(lengths),), dtype=flat.dtype, device=device)
        self.collectives.reduce_scatter_(out, flat.reshape(-1),
                                         f"keras_dist.split_weights.gradient.{self.index[id(pairs[0][0])]}.{len(pairs)}")
        out.div_(self.size)
        return [part.to(grad.device) for part, (_, grad) in zip(out.split(lengths), pairs)]

    def _gradient_ready(self, variable: keras.Variable) -> Any:
        def ready(parameter: "torch.Tensor") -> None:
            # A backward outside the train step (a callback's own, on some processes) keeps its gradient.
            if not self.active or parameter.grad is None or not self.in_train_step():
                return
            grad, parameter.grad = parameter.grad, None
            if id(variable) in self.kept_whole:
                self._add_gradients([variable], self._reduced_slices([(variable, grad)]))
                return
            self.release([variable])
            # A layer's gradients go in one reduce-scatter, once all of them are complete.
            unit = self.unit_key[id(variable)]
            waiting = self.pending.setdefault(unit, [])
            waiting.append((variable, grad))
            if len(waiting) == len(self.units[unit]):
                self._reduce_pending(unit)

        return ready

    def _reduce_pending(self, unit: int) -> None:
        waiting = self.pending.pop(unit)
        for dtype in sorted({grad.dtype for _, grad in waiting}, key=str):
            pairs = [(variable, grad) for variable, grad in waiting if grad.dtype == dtype]
            self._add_gradients([variable for variable, _ in pairs], self._reduced_slices(pairs))

    def _add_gradients(self, variables: list, reduced: list) -> None:
        for variable, part in zip(variables, reduced):
            earlier = self.gradients.get(id(variable))  # a second backward in the same step
            self.gradients[id(variable)] = part if earlier is None else earlier + part


# Optimizers whose update of each element reads only that element's gradient and state
# (and the step count), so that updating flat slices equals updating whole variables.
ELEMENTWISE_OPTIMIZERS = (keras.optimizers.SGD, keras.optimizers.Adam, keras.optimizers.AdamW,
                          keras.optimizers.Adamax, keras.optimizers.Nadam, keras.optimizers.RMSprop,
                          keras.optimizers.Adagrad, keras.optimizers.Adadelta, keras.optimizers.Ftrl,
                          keras.optimizers.Lion)


def _check_splittable(optimizer: Any) -> None:
    """One line where `shard="weights"` cannot update `optimizer` slice by slice."""
    optimizer_sharding.check_supported(optimizer)
    if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS):
        raise KerasDistError(f"shard='weights' updates flat slices of each variable, which "
                             f"{type(optimizer).__name__} cannot (its update looks at a whole variable): use "
                             f"{', '.join(o.__name__ for o in ELEMENTWISE_OPTIMIZERS)}, or shard='optimizer'")
    if optimizer.clipnorm:
        raise KerasDistError("shard='weights' does not take clipnorm yet (each process holds a slice of each "
                             "gradient): use global_clipnorm, or shard='optimizer'")
    if optimizer.global_clipnorm and (optimizer.gradient_accumulation_steps or optimizer.loss_scale_factor):
        raise KerasDistError("shard='weights' clips each step's gradients before the optimizer accumulates or "
                             "unscales them: drop global_clipnorm, or gradient_accumulation_steps and "
                             "loss_scale_factor")


def _slice_length(variable: keras.Variable, size: int) -> int:
    return slice_length(int(np.prod(variable.shape)), size)


def _parameter(variable: keras.Variable) -> "torch.nn.Parameter":
    return keras_internals.variable_value(variable)


def _reading_layers(model: keras.Model) -> dict[int, Any]:
    """id(trainable variable) -> the layer whose `call` reads it: the layer that made it,
    except inside a recurrent layer, whose own call reads its cell's variables directly
    (Keras's fused LSTM and GRU): the outermost such layer."""
    reading: dict[int, Any] = {}

    def visit(layer: Any, recurrent: Any) -> None:
        if recurrent is None and isinstance(layer, keras.layers.RNN):
            recurrent = layer
        for variable in keras_internals.own_trainable_variables(layer):
            reading.setdefault(id(variable), recurrent or layer)
        for sublayer in keras_internals.sublayers(layer):
            visit(sublayer, recurrent)

    visit(model, None)
    return reading


def _saved_in_parts(layer: Any) -> None:
    """Makes `layer`'s saves gather its split variables a layer at a time (the chief's
    save), and its loads keep this process's slice of each (once per layer object: it
    reads the layer's current `SplitWeights`)."""
    if is_overridden(layer, "save_own_variables"):
        return
    keras_save, keras_load = layer.save_own_variables, layer.load_own_variables

    def save_own_variables(store: Any) -> None:
        split = vars(layer).get(_SPLIT)
        if split is None:
            return keras_save(store)
        with split.gathered_for_save(keras_internals.own_trainable_variables(layer)):
            return keras_save(store)

    def load_own_variables(store: Any) -> None:
        split = vars(layer).get(_SPLIT)
        if split is None:
            return keras_load(store)
        with split.room_for_load(keras_internals.own_trainable_variables(layer)):
            return keras_load(store)

    override(layer, "save_own_variables", save_own_variables)
    override(layer, "load_own_variables", load_own_variables)


def _gathering_call(layer: Any, torch: Any) -> None:
    """Makes `layer.call` gather the split variables it owns while it runs, and again before
    its backward pass (once per layer object: it reads the layer's current `SplitWeights`)."""
    if is_overridden(layer, "call"):
        return
    keras_call = layer.call

    def call(*args: Any, **kwargs: Any) -> Any:
        split = vars(layer).get(_SPLIT)
        variables = split.unit_of(layer) if split is not None else []
        if not variables:
            return keras_call(*args, **kwargs)
        gathered = split.gather(variables)  # none where they are whole already (`SplitWeights.whole`)
        try:
            outputs = keras_call(*args, **kwargs)
            if torch.is_grad_enabled() and gathered:
                def before_backward(grad: Any) -> None:
                    split.gather(variables)

                for tensor in keras.tree.flatten(outputs):
                    if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                        tensor.register_hook(before_backward)
        finally:
            split.release(gathered)
        return outputs

    override(layer, "call", call)
