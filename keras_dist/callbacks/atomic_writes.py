"""Checkpoints written atomically: a crash at any moment leaves the previous good file.

Keras writes a checkpoint in place, so a process killed mid-save leaves a truncated file
(and `BackupAndRestore` then fails on every rerun). Here each save of `ModelCheckpoint`
and `BackupAndRestore` goes to a temporary name in the same directory, is flushed to
disk, and is then renamed over the real name, which a rename replaces whole or not at
all. Only the callback instance is changed (its `_save_model` and `on_train_begin`).
"""

import json
import logging
import os
import shutil

import keras

from keras_dist.callbacks.resume import METADATA_KEY
from keras_dist.overrides import override

logger = logging.getLogger("keras_dist")

_PARTIAL = ".keras_dist-partial-"
_STAGED = ".keras_dist-staged"


def make_writes_atomic(callback: keras.callbacks.Callback) -> keras.callbacks.Callback:
    """Makes `callback` (a `ModelCheckpoint` or `BackupAndRestore`, else unchanged) save atomically.

    Idempotent. A `BackupAndRestore` also survives a partial file left by an earlier,
    non-atomic save: one line says so, and training starts from the last good state
    (Keras's `.bkp` copy where `double_checkpoint=True`, else the beginning).
    """
    if "_save_model" in vars(callback):
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
    keras_save = callback._save_model

    def _save_model(epoch, batch, logs):
        model, written = callback.model, []
        previous = {name: vars(model).get(name) for name in ("save", "save_weights")}

        def to_partial_file(keras_method):
            def save(filepath, *args, **kwargs):
                final = os.fspath(filepath)
                keras_method(_partial(final), *args, **kwargs)
                written.append(final)
            return save

        for name in previous:
            object.__setattr__(model, name, to_partial_file(getattr(model, name)))
        try:
            keras_save(epoch, batch, logs)
        finally:
            for name, method in previous.items():
                if method is None:
                    del model.__dict__[name]
                else:
                    object.__setattr__(model, name, method)
        for final in written:
            publish(_partial(final), final)

    override(callback, "_save_model", _save_model)


def _atomic_backup(callback):
    keras_save, keras_train_begin = callback._save_model, callback.on_train_begin
    names = ("_weights_path", "_training_metadata_path")

    def _save_model():
        finals = [getattr(callback, n) for n in names]
        if getattr(callback, "double_checkpoint", False):  # Keras >= 3.9
            # Keras copies the latest state to its `.bkp` names first; it would copy the
            # partial names set below, which do not exist yet.
            previous = (callback._prev_weights_path, callback._prev_training_metadata_path)
            for final, backup in zip(finals, previous):
                if os.path.exists(final):
                    shutil.copyfile(final, _partial(backup))
                    publish(_partial(backup), backup)
        for name, final in zip(names, finals):
            setattr(callback, name, _partial(final))
        try:
            keras_save()
        finally:
            partials = [getattr(callback, n) for n in names]
            for name, final in zip(names, finals):
                setattr(callback, name, final)
        add_metadata = getattr(callback, "_keras_dist_metadata", None)  # `resume.ResumePoint`: the position
        if add_metadata is not None:
            with open(partials[1]) as f:
                metadata = json.load(f)
            with open(partials[1], "w") as f:
                json.dump({**metadata, METADATA_KEY: add_metadata()}, f)
        # Weights and metadata are one state, committed in three renames: the metadata is
        # staged, the weights replaced, then the staged metadata put in place. A crash
        # between the last two leaves new weights beside old metadata, which would train an
        # epoch twice; `_finish_interrupted_commit` completes that commit on the rerun.
        (partial_weights, partial_metadata), (weights, metadata) = partials, finals
        publish(partial_metadata, metadata + _STAGED)
        publish(partial_weights, weights)
        publish(metadata + _STAGED, metadata)

    def on_train_begin(logs=None):
        _finish_interrupted_commit(callback._weights_path, callback._training_metadata_path)
        try:
            keras_train_begin(logs)
        except OSError as exc:  # h5py's error for a truncated file
            if not os.path.exists(callback._weights_path):
                raise
            logger.warning("keras_dist: %s cannot be read (%s), left by a crash during an earlier save; it is moved "
                           "aside and training starts from the last good state", callback._weights_path, type(exc).__name__)
            for path in (callback._weights_path, callback._training_metadata_path):
                if os.path.exists(path):
                    os.replace(path, path + ".unreadable")
            keras_train_begin(logs)

    override(callback, "_save_model", _save_model)
    override(callback, "on_train_begin", on_train_begin)


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
    return os.path.join(directory, _PARTIAL + name)


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
