"""Weights split over JAX processes from their creation (`keras_dist.split_weights`), for good.

Inside the block Keras makes each variable without a value; at its end each trainable
float variable gets a layout split over the job's mesh, along the first axis the device
count divides (a Keras `TensorLayout`, as a `ModelParallel` layout map gives), and is
made from its initializer one at a time, each process keeping its part: the peak is the
largest variable, never the model, and the values are the unsharded model's from the
job's shared seed. Variables no axis of which divides (a bias of odd length), and the
others, are made as usual: each process's own copy.

Such a model stays split (`SplitForGood`): fit's step, one XLA computation over the mesh,
gathers each weight where it is used and updates each process's part. Outside fit:

- `evaluate` and `predict` gather every split weight whole for their duration (each
  process then steps through its own shard on its own copy, as for any model);
- saves gather one layer's split weights at a time as Keras writes them, the chief leading
  and the others following (`chief_leads.ChiefLeads`), in the script's saves and in fit's
  checkpoints; `ModelLeads` does the same for any JAX model whose optimizer's state is split;
- loads give each layer's split weights room for the whole values Keras reads, and each
  process keeps its part (`room_for_load`); a backup's restore, the chief's alone, hands
  each value it reads to the others.
"""

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import keras
import numpy as np

from keras_dist import keras_internals, optimizer_hooks
from keras_dist.errors import KerasDistError
from keras_dist.overrides import is_overridden, override
from keras_dist.split_creation import NOT_SAVED_WHOLE, SLICE
from keras_dist.strategies.chief_leads import ChiefLeads

# On a layer whose own variables are split for good: its model's `SplitForGood`.
_SPLIT = "_keras_dist_jax_split_for_good"

@contextlib.contextmanager
def built_split(layout_for: Callable[[tuple], Any], place: Callable[[Any, np.ndarray], None]) -> Iterator[None]:
    """`keras_dist.split_weights` on JAX: Keras makes the variables built in the block without
    a value (a `keras.StatelessScope`); at its end each trainable float one that splits
    (`layout_for` its shape) is made whole from its initializer, one at a time, and each
    process keeps its part on that layout (`place`, no collective: Keras's own placement,
    `jax.device_put`, checks with every process that the whole values agree, gathering
    each variable N times over); it is marked (`SLICE`: its layout). The others get
    their value as usual."""
    with keras_internals.made_without_values() as made:
        yield
    for variable in made:
        splits = variable.trainable and keras.backend.is_float_dtype(variable.dtype)
        layout = layout_for(tuple(variable.shape)) if splits else None
        if layout is None:
            keras_internals.initialize_deferred(variable)
            continue
        initializer = keras_internals.take_initializer(variable)
        whole = np.asarray(initializer(tuple(variable.shape), dtype=variable.dtype))
        keras_internals.set_jax_layout(variable, layout)
        place(variable, whole)
        del whole
        setattr(variable, SLICE, layout)


class ModelLeads(ChiefLeads):
    """The chief's lead in the saves of a JAX model whose optimizer's state is split over the
    processes (`ChiefLeads`): the state is gathered whole, in its order, once announced.

    In a backup's restore, the chief's alone, each value of the state it reads is handed to
    the others as it is read (`hand_out_loaded_state`), never held whole.

    Args:
        model: the compiled model.
        collectives: the job's `JaxProcesses`.
        place: sets a variable to a whole value, each process keeping its part (no collective).
    """

    def __init__(self, model: keras.Model, collectives: Any, place: Callable[[Any, np.ndarray], None]) -> None:
        super().__init__(collectives)
        self._model = weakref.ref(model)  # the strategy keeps leads: not the models they serve
        self._place = place

    @property
    def model(self) -> keras.Model | None:
        return self._model()

    def part_taker(self) -> Callable[[str, Any], None]:
        return self._take_part

    def _take_part(self, kind: str, detail: Any) -> None:
        from keras_dist import optimizer_sharding

        if kind == "state":  # one of the model's optimizers' (a GAN's has two), whole, in its order
            for _ in optimizer_sharding.sharded_state(optimizer_hooks.optimizers_of(self.model)[detail]).gather():
                pass
        elif kind == "loaded state":
            which, position = detail
            variable = optimizer_hooks.optimizers_of(self.model)[which].variables[position]
            self._place(variable, self.collectives.broadcast_array(np.zeros(tuple(variable.shape), variable.dtype)))

    def _which_optimizer(self, variables: list) -> int:
        """The position among the model's optimizers of the one whose variables are `variables`."""
        ids = [id(v) for v in variables]
        return next(i for i, optimizer in enumerate(optimizer_hooks.optimizers_of(self.model))
                    if [id(v) for v in optimizer.variables] == ids)

    def announce_state(self, variables: list) -> bool:
        """Before an optimizer's state (`variables`) is gathered for a save: announced, naming
        which of the model's optimizers, where the chief leads; False where a stand-in's own
        walk must gather nothing."""
        if self.leading:
            self.announce(("state", self._which_optimizer(variables)))
        return not self.standing_in

    def hand_out_loaded_state(self, variables: list, position: int, whole: np.ndarray) -> None:
        """The whole value the chief's restore read for an optimizer's (`variables`) variable at
        `position`, to the others, each of which keeps its part (`_take_part`)."""
        self.announce(("loaded state", (self._which_optimizer(variables), position)))
        self.collectives.broadcast_array(whole)


class SplitForGood(ModelLeads):
    """A model built in `keras_dist.split_weights` on JAX: its split variables, and how its
    saves and loads take them a layer at a time.

    Args:
        model: the compiled model.
        collectives: the job's `JaxProcesses`.
        whole_value: a split variable's whole value (collective: every process calls it).
        place: sets a variable to a whole value, each process keeping its part (no collective).
    """

    def __init__(self, model: keras.Model, collectives: Any, whole_value: Callable[[Any], np.ndarray],
                 place: Callable[[Any, np.ndarray], None]) -> None:
        super().__init__(model, collectives, place)
        self.variables = [v for v in model.weights if SLICE in vars(v)]  # the same order on every process
        self.index = {id(v): i for i, v in enumerate(self.variables)}
        self._whole_value = whole_value
        for layer in keras_internals.flatten_layers(model):
            if any(id(v) in self.index for v in keras_internals.own_trainable_variables(layer)):
                _saved_in_parts(layer)
                object.__setattr__(layer, _SPLIT, self)
        # Every process calls them alike (EarlyStopping restoring the best weights, a script's).
        keras_get, keras_set = model.get_weights, model.set_weights

        def get_weights() -> list:
            with self.whole():
                return keras_get()

        def set_weights(weights: list) -> None:
            with self.whole(assigned=True):
                keras_set(weights)

        override(model, "get_weights", get_weights)
        override(model, "set_weights", set_weights)

    # --- every split weight whole: evaluate, predict, get_weights and set_weights ---------
    @contextlib.contextmanager
    def whole(self, assigned: bool = False) -> Iterator[None]:
        """Every split variable whole on every process for the duration (collective), as
        this process's own copy; split again after: from the values assigned meanwhile
        where `assigned` (every process assigned the same), else as they were."""
        import jax

        with _swapped(self.variables, lambda: [jax.numpy.asarray(self._whole_value(v)) for v in self.variables],
                      self._place if assigned else None):
            yield

    def _take_part(self, kind: str, detail: Any) -> None:
        if kind == "weights":
            for i in detail:
                self._whole_value(self.variables[i])
        elif kind == "loaded weights":
            for i in detail:
                self._take_loaded(self.variables[i])
        else:
            super()._take_part(kind, detail)

    @contextlib.contextmanager
    def gathered_for_save(self, variables: list) -> Iterator[None]:
        """`variables` (one layer's) whole while Keras writes them."""
        if self.standing_in:  # its scratch copy, which nothing reads, gets empty values
            with _swapped(variables, lambda: [np.zeros((0,), v.dtype) for v in variables]):
                yield
            return
        if not self.leading:
            raise KerasDistError(NOT_SAVED_WHOLE)
        self.announce(("weights", [self.index[id(v)] for v in variables]))
        with _swapped(variables, lambda: [self._whole_value(v) for v in variables]):
            yield

    # --- loads -------------------------------------------------------------------------
    @contextlib.contextmanager
    def room_for_load(self, variables: list) -> Iterator[bool]:
        """Room for `variables` (one layer's) whole while Keras reads them; each process then
        keeps its part. Yields False where the layer must read nothing (a stand-in's own
        restore: the chief's hands out what it reads)."""
        if self.standing_in:
            yield False
            return
        read: dict[int, np.ndarray] = {}
        with _swapped(variables, lambda: [np.zeros((0,), v.dtype) for v in variables],
                      lambda variable, whole: read.__setitem__(id(variable), whole)):
            yield True
        if self.leading:  # a backup's restore, the chief's alone
            self.announce(("loaded weights", [self.index[id(v)] for v in variables]))
        for variable in variables:
            whole = read.pop(id(variable))
            self._place(variable, self.collectives.broadcast_array(whole) if self.leading else whole)

    def _take_loaded(self, variable: keras.Variable) -> None:
        """This process's part of a value the chief's restore read (`room_for_load`)."""
        whole = self.collectives.broadcast_array(np.zeros(tuple(variable.shape), variable.dtype))
        self._place(variable, whole)


@contextlib.contextmanager
def _swapped(variables: list, values: Callable[[], list],
             place: Callable[[Any, np.ndarray], None] | None = None) -> Iterator[None]:
    """Each of `variables` holds its value from `values` as this process's own array for the
    duration (no layout), and its layout again after, with its split value as it was or,
    with `place` (once the block ended without an error), split from the value it holds."""
    layouts = [getattr(v, SLICE) for v in variables]
    originals = [keras_internals.variable_value(v) for v in variables]
    assigned = False
    try:
        for variable, value in zip(variables, values()):
            keras_internals.drop_jax_layout(variable)
            keras_internals.set_jax_value(variable, value)
        yield
        assigned = place is not None
    finally:
        for variable, layout, original in zip(variables, layouts, originals):
            held = keras_internals.variable_value(variable)
            keras_internals.set_jax_layout(variable, layout)
            if assigned:
                place(variable, np.asarray(held))
            else:
                keras_internals.set_jax_value(variable, original)


def split_for_good(model: keras.Model) -> "SplitForGood | None":
    """The `SplitForGood` of a model built split (read through its layers); None for any other."""
    for layer in keras_internals.flatten_layers(model):
        split = vars(layer).get(_SPLIT)
        if split is not None and split.model is model:
            return split
    return None


def _saved_in_parts(layer: Any) -> None:
    """Makes `layer`'s saves gather its split variables while Keras writes them, and its loads
    keep this process's part of each (once per layer: it reads the layer's `SplitForGood`)."""
    if is_overridden(layer, "save_own_variables"):
        return
    keras_save, keras_load = layer.save_own_variables, layer.load_own_variables

    def own_split(split: SplitForGood) -> list:
        return [v for v in keras_internals.own_trainable_variables(layer) if id(v) in split.index]

    def save_own_variables(store: Any) -> None:
        split = vars(layer).get(_SPLIT)
        if split is None:
            return keras_save(store)
        with split.gathered_for_save(own_split(split)):
            return keras_save(store)

    def load_own_variables(store: Any) -> None:
        split = vars(layer).get(_SPLIT)
        if split is None:
            return keras_load(store)
        with split.room_for_load(own_split(split)) as reads:
            if reads:
                keras_load(store)

    override(layer, "save_own_variables", save_own_variables)
    override(layer, "load_own_variables", load_own_variables)
