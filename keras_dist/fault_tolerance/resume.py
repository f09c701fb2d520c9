"""Exact resume inside an epoch: a restarted `fit` goes on at the step after the last backup.

Keras 3's `BackupAndRestore` restores weights, optimizer state and the epoch. Its metadata
keeps the last batch, but nothing reads it, so a restarted `fit` retrains the interrupted
epoch from its first batch (tf.keras 2 skipped the consumed batches). keras_dist adds to
each backup what the rest of the epoch depends on, and puts it back on restart:

* the position: the epoch under way and the steps of it already done;
* the job's seed, from which every epoch's order is drawn (`EpochPosition.order`), so an
  epoch's order depends on the seed and its number only, never on what the process did
  before (as `DistributedSampler.set_epoch`);
* the epoch's metric states summed over processes, so its logged loss is the
  uninterrupted run's;
* the layers' random-number states (`SeedGenerator`: dropout) and the counters of
  `EarlyStopping` and `ReduceLROnPlateau`. The learning rate is optimizer state, which
  Keras's own backup holds.

The interrupted epoch then resumes at its next step: inputs whose order keras_dist draws
start there without reading what came before (`EpochPosition.sources_skip`); other inputs
(tf.data, generators) are read from the epoch's start and the consumed batches dropped.
"""

import contextlib
import csv
import json
import logging
import os
import random
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import keras
import numpy as np

from keras_dist import keras_internals
from keras_dist.fault_tolerance.atomic_writes import METADATA_KEY, keras_own_saves
from keras_dist.fault_tolerance.preemption import PreemptionNotice
from keras_dist.fault_tolerance.scratch import ScratchCallback
from keras_dist.inputs.position import EpochPosition
from keras_dist.errors import KerasDistError
from keras_dist.overrides import methods_while, override

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

logger = logging.getLogger("keras_dist")

# The inputs a backup resumes on another number of processes (`EpochPosition.resizable`).
RESIZABLE_INPUTS = ("NumPy arrays that fit shuffles (any, in an elastic job), a keras.utils.PyDataset of known "
                    "length and a torch DataLoader keras_dist splits (without drop_last), with fit's "
                    "steps_per_epoch unset")
# The state of Keras callbacks that counts across epochs, restored on resume. ModelCheckpoint's
# best value too: without it the first epoch after a restart overwrote the best checkpoint
# (as keras-team/keras#17012 reports of Keras's own BackupAndRestore).
_CALLBACK_STATE = {
    keras.callbacks.EarlyStopping: ("wait", "best", "best_epoch", "stopped_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "best", "cooldown_counter"),
    keras.callbacks.ModelCheckpoint: ("best",),
    # Its batch-level summaries' step: from 0 again, a restarted job's curves went back in time.
    keras.callbacks.TensorBoard: (keras_internals.tensorboard_step_counter(),),
}


class FollowEpochs(keras.callbacks.Callback):
    """Keeps `EpochPosition.epoch` at the epoch under way where no `ResumePoint` does (a fit
    of several processes without a backup), for the inputs whose order keras_dist draws."""

    def __init__(self, position: EpochPosition) -> None:
        super().__init__()
        self.position = position

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.position.epoch = epoch


def backup_of(callbacks: list) -> keras.callbacks.BackupAndRestore | None:
    """The `BackupAndRestore` among `callbacks`, if any (inside a worker's stand-in too,
    `keras_dist.fault_tolerance.scratch.ScratchCallback`)."""
    return next((c for c in map(_run_as, callbacks) if isinstance(c, keras.callbacks.BackupAndRestore)), None)


def _run_as(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """The callback that runs for `callback`: a worker's stand-in runs its copy."""
    return callback.inner if isinstance(callback, ScratchCallback) else callback


def automatic_backup(directory: str, call: int) -> keras.callbacks.BackupAndRestore:
    """The backup of this process's `call`-th fit under `directory` (`KERAS_DIST_BACKUP_DIR`,
    for a script without a `BackupAndRestore` of its own): at each epoch's end, every
    `KERAS_DIST_BACKUP_SECONDS` and at the preemption notice. It is kept when its fit ends, so
    that a rerun does not train a finished fit again: it restores its last state instead."""
    directory = os.path.join(directory, f"fit-{call}")
    return keras.callbacks.BackupAndRestore(directory, save_freq="epoch", delete_checkpoint=False)


class ResumePoint(keras.callbacks.Callback):
    """Saves and restores the position inside an epoch beside a `BackupAndRestore`.

    keras_dist adds it on every process wherever `fit` has a `BackupAndRestore`: first
    among the callbacks, so that every process takes a save step's snapshot at the same
    point, and its `last` part after the script's callbacks (the backup loads first). It takes the backup's
    schedule (`save_freq`): at each save step every process sums its metric states with
    the others (a collective), and the chief's backup writes them with the position into
    Keras's metadata file, in the same atomic commit
    (`keras_dist.fault_tolerance.atomic_writes`). On restart the chief reads its backup, every
    process learns the position, and the epoch starts at the next step.

    Args:
        replicas: the job as this process sees it (`Replicas`).
        backup: the `BackupAndRestore` this worker runs (the chief's writes; a stand-in's
            takes part in collective saves), or where it runs none, the script's, for
            its schedule.
        position: the fit's `EpochPosition`, shared with its training input.
        callbacks: the fit's callbacks, whose counters are saved (`EarlyStopping`,
            `ReduceLROnPlateau`).
        runs_backup: `backup` is this worker's, which saves (else it only gives the schedule).
        notice: the fit's `PreemptionNotice`: at an agreed notice, or a time-based backup
            it asks for, the backup saves (the notice then ends the process).
    """

    def __init__(self, replicas: "Replicas", backup: keras.callbacks.BackupAndRestore, position: EpochPosition,
                 callbacks: list, runs_backup: bool, notice: PreemptionNotice) -> None:
        super().__init__()
        self.replicas, self.backup, self.position, self.runs_backup = replicas, backup, position, runs_backup
        self.notice = notice
        notice.saved_in = backup.backup_dir
        self.counting = _counting_callbacks(callbacks)
        self.csv_logs = [c for c in callbacks if isinstance(c, keras.callbacks.CSVLogger)]
        self._csv_appends: list[bool] = []
        self._restored_metrics: list | None = None
        self._restored_random: dict | None = None
        self._save_at_epoch_end = False
        self._last_step = -1
        self._since_save = 0
        self._snapshot: dict | None = None
        self._decided: tuple[int, int] | None = None
        self._due = False
        # The backup asks this callback when to save (on every process: a stand-in that
        # takes part in collective saves keeps the same schedule), and what to add.
        override(backup, "_should_save_on_batch", self.due)
        override(backup, "_keras_dist_metadata", self.metadata)

    @property
    def last(self) -> keras.callbacks.Callback:
        """Its part after the script's callbacks: the restore (the backup loads first) and the
        save deferred to an epoch's end (their epoch-end counters counted first)."""
        return _AfterScriptCallbacks(self)

    def restore_position(self) -> None:
        state = _read_metadata(self.backup) if self.replicas.is_chief else None
        if self.replicas.size > 1:
            state = self.replicas.collectives.broadcast_object(state)
        position = self.position
        position.iterations = 0
        if state is None:
            position.resume_epoch = keras_internals.initial_epoch(self.model) or 0
            return
        position.seed = state["seed"]
        epoch, steps = state["epoch"], state["steps"]
        shards = self.replicas.input_plan.num_shards
        samples = state.get("samples")
        position.resume_epoch, position.skip = epoch, steps
        # (A backup without the count, written before keras_dist kept it, on the same count.)
        position.skip_samples = samples if samples is not None else steps * (position.step_samples or 0)
        if state.get("shards", shards) != shards:
            resizable = position.resizable
            if resizable is None or samples is None:
                raise KerasDistError(
                    f"the backup in {self.backup.backup_dir} was written by {state['shards']} processes; resume it on "
                    f"{state['shards']} (on another number, keras_dist resumes {RESIZABLE_INPUTS})")
            position.skip = resizable.steps - resizable.steps_after(samples)
            if self.replicas.is_chief:
                logger.info("keras_dist: the backup was written by %s processes, this run has %s: the batch size per "
                            "replica stays, the rest of epoch %s (%s %s) is split among them",
                            state["shards"], shards, epoch + 1, resizable.length - samples, resizable.unit)
        keras_internals.set_initial_epoch(self.model, epoch)
        self._last_step = steps - 1
        self._restored_metrics = state["metrics"] if steps else None
        _set_seed_states(self.model, state["seed_states"])
        random_states = state["random_states"]
        self._restored_random = random_states[self.replicas.rank % len(random_states)]
        for name, callback in self.counting:
            saved = state["callbacks"].get(name)
            if saved is not None and _keeps_own_state(callback):
                callback.set_state(saved)
            else:
                for attribute, value in (saved or {}).items():
                    setattr(callback, attribute, value)
        # Keras counts epochs from 0 in each fit: its own metadata would say epoch 0.
        keras_internals.set_backup_position(self.backup, epoch=epoch)
        if self.replicas.is_chief:
            logger.info("keras_dist: fit resumes in epoch %s after step %s, from %s", epoch + 1, steps,
                        self.backup.backup_dir)

    def on_train_begin(self, logs: dict | None = None) -> None:
        # Before the script's callbacks open their files (this callback is first): a
        # CSVLogger resumed goes on with its file, cut back to the epochs the backup holds,
        # where Keras's would start it again and lose the epochs before the restart.
        state = _read_metadata(self.backup) if self.replicas.is_chief and self.csv_logs else None
        self._csv_appends = [c.append for c in self.csv_logs]
        if state is not None:
            for csv_log in self.csv_logs:
                _keep_epochs_before(csv_log.filename, state["epoch"], csv_log.sep)
                csv_log.append = True

    def script_callbacks_began(self) -> None:
        """After the script's callbacks' `on_train_begin`: their settings as the script made them."""
        for csv_log, append in zip(self.csv_logs, self._csv_appends):
            csv_log.append = append

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self.position.epoch = epoch
        self._last_step = self.position.first_step(epoch) - 1
        if epoch != self.position.resume_epoch:
            return
        variables = [v for m in self.model.metrics for v in m.variables]
        if self._restored_metrics is not None and len(variables) == len(self._restored_metrics):
            self.replicas.metric_states.assign_global(variables, [np.asarray(a) for a in self._restored_metrics])
            self._restored_metrics = None
        # Else Keras builds the compiled metrics in the first step (TensorFlow without a
        # tf.distribute strategy, as under Horovod): they are restored after it.
        if self._restored_random is not None and not self.position.skip:
            # Saved at an epoch's end: Keras then makes the next epoch's input iterator (a
            # torch DataLoader draws its base seed from torch's state) after this point.
            _set_global_random_states(self._restored_random)
            self._restored_random = None

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        if self._restored_random is not None:
            # Saved inside the epoch: its input iterator was made before the save.
            _set_global_random_states(self._restored_random)
            self._restored_random = None

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self._restored_metrics is not None:
            self._add_restored_metrics()
        self.due(batch)  # the backup, later among the callbacks, saves where this is True

    def _add_restored_metrics(self) -> None:
        """Adds the restored metric states to those of the resumed epoch's first step, which
        built them (the chief holds the restored part, as `MetricStates.assign_global` has it).
        Exact for states that sum (totals, counts, confusion counts: every metric Keras
        compiles by name)."""
        variables = [v for m in self.model.metrics for v in m.variables]
        if len(variables) != len(self._restored_metrics):
            raise KerasDistError(f"the backup in {self.backup.backup_dir} holds {len(self._restored_metrics)} metric "
                                 f"states and the model has {len(variables)}; resume with the metrics it was saved with")
        if self.replicas.is_chief:
            for variable, restored in zip(variables, self._restored_metrics):
                variable.assign(keras.ops.convert_to_numpy(variable.value) + np.asarray(restored))
        self._restored_metrics = None

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # After keras_dist's replica check (which averages BatchNormalization statistics),
        # before the script's callbacks: every process's part of an epoch-end save.
        if self.backup.save_freq == "epoch" or self._save_at_epoch_end:
            self._snapshot = self._collective_state(epoch + 1, 0)
            self.notice.backed_up()

    def save_deferred(self, epoch: int) -> None:
        """The save due after the epoch's last step, now at its end (after the script's callbacks)."""
        if self._save_at_epoch_end:
            self._save_at_epoch_end = False
            keras_internals.set_backup_position(self.backup, epoch + 1, 0)
            if self.runs_backup:
                # Outside the backup's own hooks, where a worker's stand-in saves with Keras's
                # methods: a worker's save through keras_dist's would wait for the chief's
                # copy of its scratch file.
                with keras_own_saves(self.model):
                    keras_internals.save_backup(self.backup)

    def due(self, batch: int) -> bool:
        """Whether the backup saves after step `batch` of the epoch under way.

        Keras's schedule (`save_freq` steps, counted across epochs), decided once per
        step on every process; where it is due, every process takes the snapshot now. A
        save due after the epoch's last step is taken at the epoch's end instead, after
        its validation: a restart then begins the next epoch (Keras cannot end an epoch
        that runs no step).
        """
        key = (self.position.epoch, batch)
        if self._decided == key:
            return self._due
        self._decided = key
        freq = self.backup.save_freq
        self._since_save += batch - self._last_step
        self._last_step = batch
        self._due = (freq != "epoch" and self._since_save >= freq) or self.notice.stopping or self.notice.backup_due
        if self._due:
            self._since_save = 0
            self.notice.backed_up()
            if batch + 1 >= (self.params.get("steps") or batch + 2):
                self._due, self._save_at_epoch_end = False, True
            else:
                self._snapshot = self._collective_state(self.position.epoch, batch + 1)
                keras_internals.set_backup_position(self.backup, batch=batch)
        self.notice.exit_deferred = self._save_at_epoch_end
        return self._due

    def metadata(self) -> dict:
        """keras_dist's part of the metadata the chief's backup writes now: the snapshot's
        collective part, and what the chief holds as every process does, read now (the
        script's callbacks have counted this step or epoch)."""
        model = self.model  # on JAX, reading it brings the step's state into the variables
        return {**self._snapshot, "seed_states": _seed_states(model),
                "callbacks": {name: _callback_state(c) for name, c in self.counting}}

    def _collective_state(self, epoch: int, steps: int) -> dict:
        """The position, and what differs from process to process, gathered (a collective)."""
        model = self.model
        variables = [v for m in model.metrics for v in m.variables] if steps else []
        metrics = self.replicas.metric_states.global_values(variables) if variables else []
        step_samples = self.position.step_samples
        return {"epoch": epoch, "steps": steps, "seed": self.position.seed,
                "shards": self.replicas.input_plan.num_shards,
                "samples": None if step_samples is None else
                self.position.first_sample(epoch) + (steps - self.position.first_step(epoch)) * step_samples,
                "metrics": [np.asarray(m).tolist() for m in metrics],
                "random_states": self.replicas.collectives.allgather_object(_global_random_states())}


class _AfterScriptCallbacks(keras.callbacks.Callback):
    def __init__(self, resume_point: ResumePoint) -> None:
        super().__init__()
        self.resume_point = resume_point

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.resume_point.script_callbacks_began()
        self.resume_point.restore_position()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        self.resume_point.save_deferred(epoch)


def _read_metadata(backup: keras.callbacks.BackupAndRestore) -> dict | None:
    """keras_dist's part of the backup's metadata (None: no backup, or one Keras wrote alone)."""
    path = keras_internals.backup_files(backup)[1]
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f).get(METADATA_KEY)


def _keep_epochs_before(path: str, epoch: int, separator: str) -> None:
    """Cuts a CSVLogger's file back to its header and the rows of epochs before `epoch`
    (replaced whole, as keras_dist writes checkpoints)."""
    if not os.path.exists(path):
        return
    with open(path, newline="") as f:
        rows = list(csv.reader(f, delimiter=separator))
    kept = rows[:1] + [row for row in rows[1:] if row and row[0].isdigit() and int(row[0]) < epoch]
    partial = f"{path}.keras_dist-partial"
    with open(partial, "w", newline="") as f:
        csv.writer(f, delimiter=separator).writerows(kept)
    os.replace(partial, path)


def _keeps_own_state(callback: Any) -> bool:
    """Whether a script's callback saves its own state: `get_state()` returns what JSON can
    hold, which `set_state(state)` puts back on resume (docs/fault-tolerance.md)."""
    return callable(getattr(callback, "get_state", None)) and callable(getattr(callback, "set_state", None))


def _callback_state(callback: Any) -> Any:
    if _keeps_own_state(callback):
        return callback.get_state()
    return {a: _plain(getattr(callback, a)) for a in _CALLBACK_STATE[type(callback)] if hasattr(callback, a)}


def _counting_callbacks(callbacks: list) -> list:
    """(name, callback) of the fit's callbacks whose counters span epochs, named by type and rank
    (a worker's stand-in counts as the copy it runs, `ScratchCallback.inner`)."""
    seen: dict[str, int] = {}
    named = []
    for callback in map(_run_as, callbacks):
        if type(callback) in _CALLBACK_STATE or _keeps_own_state(callback):
            kind = type(callback).__name__
            named.append((f"{kind}_{seen.get(kind, 0)}", callback))
            seen[kind] = seen.get(kind, 0) + 1
    return named


def _seed_generators(model: keras.Model) -> list:
    return [g for layer in keras_internals.flatten_layers(model) for g in keras_internals.seed_generators(layer)]


def _seed_states(model: keras.Model) -> list:
    return [keras.ops.convert_to_numpy(g.state.value).tolist() for g in _seed_generators(model)]


def _set_seed_states(model: keras.Model, states: list) -> None:
    generators = _seed_generators(model)
    if len(generators) == len(states):
        for generator, state in zip(generators, states):
            generator.state.assign(np.asarray(state, dtype=keras.backend.standardize_dtype(generator.state.dtype)))


def _global_random_states() -> dict:
    """This process's global random states: Python's and NumPy's (a script's augmentation
    may draw from them) and, on PyTorch, torch's (Keras's unseeded dropout draws from it)."""
    states = {"python": random.getstate(), "numpy": [a.tolist() if isinstance(a, np.ndarray) else a
                                                     for a in np.random.get_state()]}
    torch = sys.modules.get("torch")
    if torch is not None:
        states["torch"] = torch.get_rng_state().tolist()
    return json.loads(json.dumps(states))  # as the backup holds them, whether saved or not


def _set_global_random_states(states: dict) -> None:
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, position, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), position, has_gauss, cached))
    torch = sys.modules.get("torch")
    if torch is not None and "torch" in states:
        torch.set_rng_state(torch.tensor(states["torch"], dtype=torch.uint8))


def _plain(value: Any) -> Any:
    """A value JSON can hold (NumPy scalars become Python numbers)."""
    return value.item() if isinstance(value, np.generic) else value


@contextlib.contextmanager
def resume_inside_epoch(model: keras.Model, position: EpochPosition) -> Iterator[None]:
    """While `fit` runs, its epochs start at `EpochPosition.first_step`.

    Keras builds each fit's epoch iterator inside `fit` and hands it first to the model's
    `_symbolic_build` (JAX, PyTorch) or `_maybe_symbolic_build` (TensorFlow); here those
    are wrapped on this model instance, for this fit only, to take the iterator and
    make it start the epoch resumed at its next step: the steps before are not run, and
    their batches are not read where the input skips them itself.
    """
    names = [n for n in ("_symbolic_build", "_maybe_symbolic_build") if hasattr(model, n)]
    taken = []

    def taking(build):
        def take_iterator(*args, iterator=None, **kwargs):
            if iterator is not None and not taken:
                taken.append(iterator)
                _start_at_resume_step(iterator, position)
            return build(*args, iterator=iterator, **kwargs)
        return take_iterator

    with methods_while(model, {name: taking(getattr(model, name)) for name in names}):
        yield


def _start_at_resume_step(epoch_iterator: Any, position: EpochPosition) -> None:
    keras_enumerate = keras_internals.batch_enumerator(epoch_iterator)

    def enumerate_from_resume_step():
        first = position.first_step(position.epoch)
        for begin, end, batches in keras_enumerate():
            if begin < first:
                if not position.sources_skip:
                    for _ in range(end - begin + 1):
                        next(batches)  # read, and dropped: done before the restart
                continue
            yield begin, end, batches

    override(epoch_iterator, "_enumerate_iterator", enumerate_from_resume_step)
