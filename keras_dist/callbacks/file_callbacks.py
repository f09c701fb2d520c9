"""Callbacks that write files: Keras's run on the chief alone; the script's own, where it says so.

keras_dist runs Keras's own file callbacks (`FILE_WRITING_CALLBACKS`) on the chief alone
(`callbacks_for_this_worker`). A callback of the script's own (a GAN's image monitor, a
report writer) runs on every worker, as every callback must where it may read logs or
take part in a collective; where it writes files, every worker writes them, at the same
paths, racing the chief. `chief_only(callback)` runs it on the chief alone. Otherwise, on
a worker other than the chief, the first file such a callback opens for writing during
`fit` is logged in one line that names the file, the callback and the fix (`watched`: a
Python audit hook on `open`, installed once per process; it sees files opened from
Python, not from C libraries).
"""

import contextlib
import logging
import os
import sys
import weakref
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

import keras

from keras_dist import keras_internals
from keras_dist.errors import KerasDistError
from keras_dist.fault_tolerance.atomic_writes import make_log_failures_warn, make_writes_atomic

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

logger = logging.getLogger("keras_dist")
CallbackT = TypeVar("CallbackT", bound=keras.callbacks.Callback)

# Callbacks that write under a user-given path. A user subclass of one counts too.
FILE_WRITING_CALLBACKS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
)
# Those of them that save the model's state.
_SAVING_CALLBACKS = (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)
_CHIEF_ONLY: "weakref.WeakSet[keras.callbacks.Callback]" = weakref.WeakSet()
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT


def chief_only(callback: CallbackT) -> CallbackT:
    """Runs `callback` on the chief alone; the other workers leave it out of `fit`.

    For a callback of yours that only writes files (images, reports): under keras_dist
    every worker runs your callbacks, so each would write them. Not for a callback that
    changes training (the learning rate, stopping), which every worker needs. Keras's own
    file callbacks (`ModelCheckpoint`, `TensorBoard`...) are the chief's already: through
    `chief_only` they stay as they are, run elsewhere as stand-ins where saves are
    collectives (every worker takes part in them).

    Returns `callback` itself: `callbacks=[keras_dist.callbacks.chief_only(GANMonitor())]`.
    """
    if not isinstance(callback, keras.callbacks.Callback):
        raise TypeError(f"chief_only takes a keras.callbacks.Callback, got {type(callback).__name__}")
    _CHIEF_ONLY.add(callback)
    return callback


def callbacks_for_this_worker(callbacks: Iterable[keras.callbacks.Callback] | keras.callbacks.CallbackList | None,
                              replicas: "Replicas", collective_saves: bool = False,
                              fit: bool = True) -> list[keras.callbacks.Callback]:
    """The user's callbacks as this worker must run them.

    Args:
        callbacks: a list of callbacks, a `keras.callbacks.CallbackList`, or None.
        replicas: the job as this process sees it (`Replicas`).
        collective_saves: the model's saves gather every process's share of its state
            (`shard="optimizer"`): a worker runs a stand-in of each checkpoint and backup
            (`CheckpointIO.collective_save_stand_in`).
        fit: the callbacks are `fit`'s, where stand-ins save: every process then takes the
            chief's save schedules (`chiefs_save_schedules`, a collective).

    Returns:
        A new list. On the chief, every callback, checkpoints written atomically
        (`make_writes_atomic`), logs that cannot be written warning once in a job of several processes
        (`make_log_failures_warn`). On other workers, those passed through `chief_only` are
        left out (not Keras's own file callbacks, the chief's already), and Keras's
        file-writing callbacks dropped or, where the strategy's
        saves are collective (every worker must take part in a save), replaced by the
        strategy's stand-in (`CheckpointIO.worker_callback`).
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    callbacks = list(callbacks or [])
    io = replicas.checkpoint_io
    stand_ins = replicas.size > 1 and (collective_saves or io.workers_save_in_scratch)
    schedules = chiefs_save_schedules(callbacks, replicas) if stand_ins and fit else {}
    if replicas.is_chief:
        # One process keeps Keras's behaviour for logs: the script sees the error as without keras_dist.
        guard_logs = make_log_failures_warn if replicas.size > 1 else (lambda c: c)
        return [io.chief_callback(guard_logs(make_writes_atomic(c)))
                if isinstance(c, FILE_WRITING_CALLBACKS) else c for c in callbacks]
    kept = [io.collective_save_stand_in(c, schedules.get(id(c))) if collective_saves and isinstance(c, _SAVING_CALLBACKS)
            else io.worker_callback(c, schedules.get(id(c))) if isinstance(c, FILE_WRITING_CALLBACKS) else c
            for c in callbacks if c not in _CHIEF_ONLY or isinstance(c, FILE_WRITING_CALLBACKS)]
    return [c for c in kept if c is not None]


def chiefs_save_schedules(callbacks: list[keras.callbacks.Callback], replicas: "Replicas") -> dict[int, dict]:
    """The save counters of the chief's checkpoints and backups (`keras_internals.save_schedule`),
    by the id of this process's callback at the same place: a stand-in saves at the chief's
    steps whatever fits the callback ran in before (one shared with an unsharded model's fit
    advanced on the chief alone). Every process calls it at once (one small allgather).

    Raises:
        KerasDistError: the processes pass fit different checkpoints or backups (the chief
            alone its `ModelCheckpoint`, as Horovod's examples do): each save would wait
            for processes that never take part.
    """
    saving = [c for c in callbacks if isinstance(c, _SAVING_CALLBACKS)]
    names = [type(c).__name__ for c in saving]
    found = replicas.collectives.allgather_object(
        (names, [keras_internals.save_schedule(c) for c in saving] if replicas.is_chief else None))
    differing = [rank for rank, (theirs, _) in enumerate(found) if theirs != found[0][0]]
    if differing:
        rank = differing[0]
        raise KerasDistError(
            f"rank 0 passes fit {found[0][0] or 'no checkpoints'} and rank {rank} passes {found[rank][0] or 'none'}: where "
            "every process takes part in a save (shard=, MultiWorkerMirrored) every process passes fit the same "
            "ModelCheckpoint and BackupAndRestore callbacks, whose files keras_dist writes on the chief alone; "
            "pass them on every process")
    return {id(c): schedule for c, schedule in zip(saving, found[0][1])}


class _Watch:
    """The rank of the fit watched now (None: none), and whether this process has warned."""

    rank: int | None = None
    warned = False
    hooked = False


def _writes(mode: str | None, flags: int) -> bool:
    if isinstance(mode, str) and any(c in mode for c in "wax+"):
        return True
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)


def _script_callback_on_stack() -> keras.callbacks.Callback | None:
    """The script's own callback (neither Keras's nor keras_dist's, nor a file callback
    keras_dist already keeps to the chief) whose code is on the stack, if any."""
    frame = sys._getframe(2)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, keras.callbacks.Callback) and not isinstance(owner, FILE_WRITING_CALLBACKS) \
                and not type(owner).__module__.startswith(("keras.", "keras_dist.")):
            return owner
        frame = frame.f_back
    return None


def _on_audit_event(event: str, args: tuple) -> None:
    if event != "open" or _Watch.rank is None or _Watch.warned:
        return
    path, mode, flags = args
    if not isinstance(path, (str, bytes, os.PathLike)) or not _writes(mode, flags):
        return
    callback = _script_callback_on_stack()
    if callback is None:
        return
    _Watch.warned = True
    name = type(callback).__name__
    logger.warning("keras_dist: rank %s writes %s from your callback %s, as the chief does (every worker runs your "
                   "callbacks); pass it as keras_dist.callbacks.chief_only(%s(...)), or write only where "
                   "keras_dist.current().is_chief", _Watch.rank, os.fsdecode(path), name, name)


@contextlib.contextmanager
def watched(replicas: "Replicas") -> Iterator[None]:
    """While `fit` runs: on a worker other than the chief, the first file a callback of the
    script's opens for writing is logged, once per process."""
    if replicas.is_chief or replicas.size == 1:
        yield
        return
    if not _Watch.hooked:
        sys.addaudithook(_on_audit_event)  # cannot be removed: idle outside `watched`
        _Watch.hooked = True
    _Watch.rank = replicas.rank
    try:
        yield
    finally:
        _Watch.rank = None
