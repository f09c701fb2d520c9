"""How one engine's processes write the model's checkpoints: `CheckpointIO`.

Every save goes through it: the chief's `ModelCheckpoint` and `BackupAndRestore` (the
script's and `keras-dist launch --backup-dir`'s, via `callbacks_for_this_worker`), what the
other processes run instead (nothing, or a stand-in saving into scratch where a save is a
collective), the script's own `save`/`save_weights`/`export` (`script_saves`), and the
gathers of sharded optimizer state (`optimizer_sharding`), which need the weights whole.
A strategy declares its engine's answers when it is made, as it declares its `InputPlan`;
the part holds no engine.
"""

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import keras

from keras_dist import keras_internals
from keras_dist.fault_tolerance.scratch import ScratchCallback
from keras_dist.overrides import is_overridden, override

ModelContext = Callable[[keras.Model], contextlib.AbstractContextManager[Any]]
# Marks a callback whose saves already run inside the engine's context (fit called again).
_WRAPPED = "_keras_dist_saves_within"


def _no_context(model: keras.Model) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


class CheckpointIO:
    """One engine's checkpoint writing, as its strategy declares it.

    Args:
        whole_weights: context in which the model's weights are whole on every process,
            where the engine splits them over processes while fit runs (a collective:
            every process enters it). Default: they always are.
        split_weight_ids: the ids of the weights split over processes now (one copy in
            the job, not one per process). Default: none.
        saves_within: context in which a process writes the model (JAX: on this process's
            devices alone; split weights: gathered whole). Default: none.
        restores_within: `BackupAndRestore`'s restore at fit's start runs in
            `saves_within` (or `checkpoints_within`) too.
        checkpoints_within: context in which the chief's checkpoints of fit, and every
            other process's stand-ins, write the model, where it differs from the script's
            own saves' (weights split for good: every process walks the save at once).
            Default: `saves_within`.
        workers_save_in_scratch: every save is a collective (MultiWorkerMirrored): the
            other processes run a copy of each file callback against scratch directories.
        saves_by_layer: for a model whose weights stay split (`keras_dist.split_weights`),
            what gathers them a layer at a time in the script's saves (`leading_save` on the
            chief, `follow` on the others); None for any other. Default: None.
    """

    def __init__(self, *, whole_weights: ModelContext = _no_context,
                 split_weight_ids: Callable[[], Collection[int]] = tuple, saves_within: ModelContext = _no_context,
                 restores_within: bool = False, workers_save_in_scratch: bool = False,
                 saves_by_layer: Callable[[keras.Model], Any] = lambda model: None,
                 checkpoints_within: ModelContext | None = None) -> None:
        self.whole_weights = whole_weights
        self._split_weight_ids = split_weight_ids
        self._saves_within = saves_within
        self._restores_within = restores_within
        self._workers_save_in_scratch = workers_save_in_scratch
        self.saves_by_layer = saves_by_layer
        self._checkpoints_within = checkpoints_within or saves_within

    def saving(self, model: keras.Model) -> contextlib.AbstractContextManager[Any]:
        """Context in which this process writes `model`: the chief's saves, and a save of the
        script's own (`script_saves`)."""
        return self._saves_within(model)

    def replicated_weights(self, weights: Sequence[keras.Variable]) -> list:
        """Those of `weights` each process holds a copy of, which can differ across processes."""
        split = self._split_weight_ids()
        return [w for w in weights if id(w) not in split]

    def chief_callback(self, callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
        """A checkpoint or log callback as the chief runs it: its saves (and, where declared,
        its restore) inside the engine's `checkpoints_within`; the other hooks, off the
        per-batch path, and the log callbacks, which only read, as they are."""
        saves = isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore))
        if self._checkpoints_within is _no_context or not saves or is_overridden(callback, _WRAPPED):
            return callback
        hooks = {"_save_model": keras_internals.save_method(callback)}
        if self._restores_within and isinstance(callback, keras.callbacks.BackupAndRestore):
            hooks["on_train_begin"] = callback.on_train_begin
        for name, hook in hooks.items():
            def within(*args: Any, _hook: Callable[..., Any] = hook, **kwargs: Any) -> Any:
                with self._checkpoints_within(callback.model):
                    return _hook(*args, **kwargs)

            override(callback, name, within)
        override(callback, _WRAPPED, True)
        return callback

    @property
    def workers_save_in_scratch(self) -> bool:
        """Whether every save is a collective, so that the other processes run stand-ins."""
        return self._workers_save_in_scratch

    def worker_callback(self, callback: keras.callbacks.Callback,
                        schedule: dict[str, Any] | None = None) -> keras.callbacks.Callback | None:
        """What a process other than the chief runs for a checkpoint or log callback: None to
        drop it, or, where saves are collectives, a stand-in saving into scratch (`schedule`:
        as `collective_save_stand_in`'s)."""
        return self._scratch_copy(callback, schedule) if self._workers_save_in_scratch else None

    def collective_save_stand_in(self, callback: keras.callbacks.Callback,
                                 schedule: dict[str, Any] | None = None) -> keras.callbacks.Callback:
        """What a process other than the chief runs for a `ModelCheckpoint` or `BackupAndRestore`
        where the model's saves gather every process's share of sharded state: a copy saving
        into a scratch directory of its own, run as the chief runs its saves.

        Args:
            callback: the script's callback, as this process holds it.
            schedule: the counters of the chief's callback at fit's start
                (`keras_internals.save_schedule`), so that both save at the same steps.
        """
        stand_in = self._scratch_copy(callback, schedule)
        self.chief_callback(stand_in.inner)
        return stand_in

    @staticmethod
    def _scratch_copy(callback: keras.callbacks.Callback, schedule: dict[str, Any] | None) -> ScratchCallback:
        """A scratch copy of `callback` for one run, made afresh (the script may change its
        settings between fits; an empty scratch directory), at the chief's save schedule."""
        copy = ScratchCallback(callback)
        for name, value in (schedule or {}).items():  # the attributes `keras_internals.save_schedule` read
            setattr(copy.inner, name, value)
        return copy
