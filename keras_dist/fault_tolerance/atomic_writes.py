"""Checkpoints written atomically: a crash at any moment leaves the previous good file.

Keras writes a checkpoint in place, so a process killed mid-save leaves a truncated file
(and `BackupAndRestore` then fails on every rerun). Here each save of `ModelCheckpoint`
and `BackupAndRestore` goes to a temporary name in the same directory, is flushed to
disk, and is then renamed over the real name, which a rename replaces whole or not at
all. Only the callback instance is changed (its `_save_model` and `on_train_begin`, and
a `BackupAndRestore`'s `on_train_end`). A backup's weights are written in the background
(`keras_dist.fault_tolerance.background_writes`).
"""

import contextlib
import errno
import json
import logging
import os
import re
import shutil
from collections.abc import Iterator

import keras
import numpy as np

from keras_dist import keras_internals, split_creation
from keras_dist.errors import KerasDistError
from keras_dist.fault_tolerance.background_writes import BackgroundWrite, WeightsSnapshot
from keras_dist.overrides import is_overridden, methods_while, override

logger = logging.getLogger("keras_dist")

# Every partial file or directory keras_dist writes begins with this (a crash may leave one).
PARTIAL_PREFIX = ".keras_dist-partial-"
_STAGED = ".keras_dist-staged"
BACKUP_OPTION = "BackupAndRestore's backup_dir (keras-dist launch --backup-dir)"


# The model methods that write a file; `script_saves` makes them the chief's in a job of several processes.
SAVING_METHODS = ("save", "save_weights", "export")
# The key of keras_dist's part of Keras's `training_metadata.json` (`resume` reads it back).
METADATA_KEY = "keras_dist"


def keras_own_saves(model: keras.Model) -> contextlib.AbstractContextManager[None]:
    """Context in which `model`'s saving methods are Keras's own: for saves keras_dist makes on
    one process (the chief's checkpoints, a worker's scratch copy), which no other process
    matches with a save of its own (`script_saves`)."""
    return methods_while(model, {name: getattr(type(model), name).__get__(model) for name in SAVING_METHODS
                                 if hasattr(type(model), name)})


def make_writes_atomic(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Makes `callback` (a `ModelCheckpoint` or `BackupAndRestore`, else unchanged) save atomically.

    Idempotent. A `BackupAndRestore` also survives a partial file left by an earlier,
    non-atomic save: one line says so, and training starts from the last good state
    (Keras's `.bkp` copy where `double_checkpoint=True`, else the beginning).
    """
    if is_overridden(callback, "_save_model"):
        return callback
    if isinstance(callback, keras.callbacks.BackupAndRestore):
        _atomic_backup(callback)
    elif isinstance(callback, keras.callbacks.ModelCheckpoint):
        _atomic_checkpoint(callback)
    return callback


def _atomic_checkpoint(callback):
    """The model's own save goes to a partial file while Keras's `_save_model` runs, so
    Keras decides and names everything as without keras_dist (its messages name the real
    file); the partial file is published under the real name afterwards."""
    keras_save = keras_internals.save_method(callback)

    def _save_model(epoch, batch, logs):
        model, written = callback.model, []

        def to_partial_file(keras_method):
            def save(filepath, *args, **kwargs):
                final = os.fspath(filepath)
                with _failed_writes_end_in_one_line(final, [_partial(final)], "ModelCheckpoint's filepath"):
                    _room_for(model, final)
                    keras_method(_partial(final), *args, **kwargs)
                written.append(final)
            return save

        # Keras's own methods: the model's `save` may be keras_dist's (`script_saves`), which
        # counts the saves every process makes; this one is the chief's alone.
        with keras_own_saves(model):
            with methods_while(model, {name: to_partial_file(getattr(model, name)) for name in ("save", "save_weights")}):
                keras_save(epoch, batch, logs)
        for final in written:
            publish(_partial(final), final)

    override(callback, "_save_model", _save_model)


def _room_for(model: keras.Model, path: str) -> None:
    """Raises ENOSPC where the file system of `path` has less room than `model`'s variables
    take: HDF5 that runs out of space in the middle of a write from the training thread
    sometimes ends the process with a segmentation fault (1 run in 4 here) before its
    error reaches Python."""
    directory = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(directory):
        return  # Keras makes it; the write then reports what is wrong
    needed = sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in model.variables)
    disk = os.statvfs(directory)
    if disk.f_bavail * disk.f_frsize < needed:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


def _atomic_backup(callback):
    """Keras's `_save_model` runs with the backup's paths set to partial names, and the
    weights it saves copied to host memory (`background_writes.WeightsSnapshot`); a
    thread then writes them and commits the backup, while training goes on."""
    keras_save = keras_internals.save_method(callback)
    keras_train_begin, keras_train_end = callback.on_train_begin, callback.on_train_end
    writes, snapshot = BackgroundWrite(), WeightsSnapshot()

    def _save_model():
        writes.wait()  # the previous backup is committed: its partial names are free again
        finals = keras_internals.backup_files(callback)
        partials = [_partial(final) for final in finals]
        for partial in partials:  # left by a crash during an earlier save
            if os.path.exists(partial):
                os.remove(partial)
        keras_internals.set_backup_files(callback, *partials)
        with _failed_writes_end_in_one_line(finals[0], partials, BACKUP_OPTION):
            try:
                model = callback.model
                if split_creation.built_split(model):  # no host copy of a model no process may hold whole:
                    with keras_own_saves(model):  # written now, a layer at a time, to its partial name
                        keras_save()
                    write_weights = _written_already
                else:
                    with methods_while(model, {"save_weights": lambda *args, **kwargs: snapshot.take(model)}):
                        keras_save()  # writes the metadata to its partial name
                    write_weights = snapshot.write
            finally:
                keras_internals.set_backup_files(callback, *finals)
            add_metadata = getattr(callback, "_keras_dist_metadata", None)  # `resume.ResumePoint`: the position
            if add_metadata is not None:
                with open(partials[1]) as f:
                    metadata = json.load(f)
                with open(partials[1], "w") as f:
                    json.dump({**metadata, METADATA_KEY: add_metadata()}, f)
        # Keras >= 3.9 copies the latest state to its `.bkp` names first (here in the
        # commit, where the latest state is complete on disk).
        previous = keras_internals.previous_backup_files(callback)
        writes.start(lambda: _commit(write_weights, partials, finals, previous))

    def on_train_begin(logs=None):
        writes.wait()
        weights, metadata = keras_internals.backup_files(callback)
        _finish_interrupted_commit(weights, metadata)
        try:
            keras_train_begin(logs)
        except OSError as exc:  # h5py's error for a truncated file
            if not os.path.exists(weights):
                raise
            logger.warning("keras_dist: %s cannot be read (%s), left by a crash during an earlier save; it is moved "
                           "aside and training starts from the last good state", weights, type(exc).__name__)
            for path in (weights, metadata):
                if os.path.exists(path):
                    os.replace(path, path + ".unreadable")
            keras_train_begin(logs)

    def on_train_end(logs=None):
        writes.wait()  # the last backup is on disk before Keras may delete the directory
        keras_train_end(logs)

    override(callback, "_save_model", _save_model)
    override(callback, "on_train_begin", on_train_begin)
    override(callback, "on_train_end", on_train_end)


def _written_already(path: str) -> None:
    """The weights' write of a backup written at its step (`_atomic_backup`)."""


def _commit(write_weights, partials, finals, previous):
    """Writes the weights from host memory and commits the backup (in the writing thread)."""
    (partial_weights, partial_metadata), (weights, metadata) = partials, finals
    # Everything up to the staged metadata can fail (a full disk) and leave the committed backup as it was.
    try:
        with _failed_writes_end_in_one_line(weights, [*partials, *(_partial(b) for b in previous), metadata + _STAGED],
                                            BACKUP_OPTION):
            for final, backup in zip(finals, previous):
                if os.path.exists(final):
                    shutil.copyfile(final, _partial(backup))
                    publish(_partial(backup), backup)
            write_weights(partial_weights)
            # Weights and metadata are one state, committed in three renames: the metadata is
            # staged, the weights replaced, then the staged metadata put in place. A crash
            # between the last two leaves new weights beside old metadata, which would train an
            # epoch twice; `_finish_interrupted_commit` completes that commit on the rerun.
            publish(partial_metadata, metadata + _STAGED)
        # The directory may also be removed between the last renames.
        with _failed_writes_end_in_one_line(weights, [], BACKUP_OPTION):
            publish(partial_weights, weights)
            publish(metadata + _STAGED, metadata)
    except _RemovedWhileWriting:
        # Removed under the job (a clean-up of /tmp): what it held is gone whatever we do,
        # and Keras makes the directory again at its next save, so training goes on.
        logger.warning("keras_dist: %s was removed while a backup was written into it; this backup is skipped, and "
                       "the next one makes the directory again", os.path.dirname(os.path.abspath(weights)))


@contextlib.contextmanager
def _failed_writes_end_in_one_line(path: str, partials: list[str], option: str) -> Iterator[None]:
    """Turns a failed write (a full disk, a read-only or removed directory) into one line that
    names `path`, the errno and the fix, after removing the `partials`, which would fill the
    disk again at the next attempt. The committed file, if any, is left as it was."""
    try:
        yield
    except (OSError, RuntimeError) as exc:  # h5py reports a failed write as a RuntimeError naming the errno
        number = exc.errno if isinstance(exc, OSError) and exc.errno else _errno_in(str(exc))
        if number is None:
            raise
        for partial in partials:
            with contextlib.suppress(OSError):
                os.remove(partial)
        kept = "the last committed one is kept" if os.path.exists(path) else "nothing was committed there yet"
        directory = os.path.dirname(os.path.abspath(path))
        fix = (f"free space in {directory}" if number in (errno.ENOSPC, errno.EDQUOT)
               else f"make {directory} writable" if number in (errno.EROFS, errno.EACCES, errno.EPERM)
               else f"check {directory}")
        # Keras makes the directory before each save, so a missing file or directory was removed under the write.
        failure = _RemovedWhileWriting if number == errno.ENOENT else KerasDistError
        raise failure(
            f"cannot write {path}: {os.strerror(number)} (errno {number}); partial files removed, {kept}; {fix}, "
            f"or choose another {option}, then run the same command again") from None


class _RemovedWhileWriting(KerasDistError):
    """A write found its file or directory removed (errno ENOENT) while it ran."""


def _errno_in(message: str) -> int | None:
    found = re.search(r"errno = (\d+)", message)
    if found:
        return int(found.group(1))
    # TensorFlow's file errors give the system's text alone ("...; No space left on device").
    return next((number for number in _FILE_SYSTEM_ERRNOS if os.strerror(number) in message), None)


_FILE_SYSTEM_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.ENOENT)
_LOG_WRITERS = (keras.callbacks.TensorBoard, keras.callbacks.CSVLogger)


def make_log_failures_warn(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Makes a `TensorBoard` or `CSVLogger` (else unchanged) that cannot write warn once and stop writing.

    Logs are not the training: a full or read-only disk under them costs one line naming the
    path, the errno and the fix, and training goes on without them. Backups and checkpoints,
    which a restart needs, end the job instead (`make_writes_atomic`). Idempotent.
    """
    if not isinstance(callback, _LOG_WRITERS) or _LOG_GUARD in vars(callback):
        return callback
    path = callback.log_dir if isinstance(callback, keras.callbacks.TensorBoard) else callback.filename
    failed = []

    def guarded(keras_hook):
        def hook(*args, **kwargs):
            if failed:
                return None
            try:
                return keras_hook(*args, **kwargs)
            except Exception as exc:  # OSError, h5py's RuntimeError or TensorFlow's ResourceExhaustedError
                number = exc.errno if isinstance(exc, OSError) and exc.errno else _errno_in(str(exc))
                if number is None:
                    raise
                failed.append(number)
                directory = path if isinstance(callback, keras.callbacks.TensorBoard) else os.path.dirname(path)
                logger.warning("keras_dist: cannot write %s: %s (errno %d); %s writes nothing more in this run and "
                               "training goes on; free space in %s or make it writable, or give it another path",
                               path, os.strerror(number), number, type(callback).__name__, directory or ".")
                return None
        return hook

    for name in dir(callback):  # TensorBoard writes the model's summary from `set_model`
        if (name.startswith("on_") or name == "set_model") and callable(getattr(callback, name)):
            override(callback, name, guarded(getattr(callback, name)))
    override(callback, _LOG_GUARD, True)
    return callback


_LOG_GUARD = "_keras_dist_log_failures_warn"


def _finish_interrupted_commit(weights, metadata):
    staged = metadata + _STAGED
    if not os.path.exists(staged):
        return
    if os.path.exists(_partial(weights)):  # the crash came before the weights' rename
        os.remove(staged)
    else:
        os.replace(staged, metadata)


def _partial(path):
    directory, name = os.path.split(path)
    return os.path.join(directory, PARTIAL_PREFIX + name)


def publish(partial: str | os.PathLike[str], final: str | os.PathLike[str]) -> None:
    """Flushes `partial` to disk and renames it to `final`, replacing it in one step."""
    with open(partial, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(partial, final)
    directory = os.open(os.path.dirname(os.path.abspath(final)), os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)
