"""The script's own `tf.train.Checkpoint` saves in a job of several processes: written once, by the chief.

TensorFlow's multi-worker tutorial saves with `tf.train.CheckpointManager.save()` on every
worker, into one directory: both workers wrote `ckpt-1` at once, and MergeV2Checkpoints
failed on one of them. keras_dist patches no TensorFlow class; it sees each checkpoint
when the checkpoint creates its save counter, the variable its first `save` or `restore`
creates (`keras_dist.variable_creation`), and replaces that one
object's `_write`, which `Checkpoint.save`, `Checkpoint.write` and `CheckpointManager.save`
all end in:

* the chief writes as TensorFlow does (its files, then the manager's `checkpoint` state
  file), then records how many saves of that series (directory and name, less the number
  `save` appends) it has committed, on the directory: the manager deletes old files, and
  a process running behind may wait for one already deleted;
* every other process writes nothing: it waits for that record and returns the same path,
  so its next line may restore it. The manager's bookkeeping (its state file, deleting
  old checkpoints) is the chief's alone, so another process's `manager.latest_checkpoint`
  stays where it was when the manager was made; `tf.train.latest_checkpoint(directory)`
  reads the chief's.

A checkpoint only ever `write`n, never saved nor restored, creates no save counter: every
process writes it (`docs/semantics.md`).
"""

import os
import re
import sys
from typing import TYPE_CHECKING, Any

from keras_dist import variable_creation
from keras_dist.fault_tolerance.script_saves import CommitRecord, written_once
from keras_dist.overrides import override

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

def watch(replicas: "Replicas") -> None:
    """In a job of several TensorFlow processes: makes each `tf.train.Checkpoint` write once,
    from the chief, from its first `save` or `restore` on."""
    import keras

    if replicas.size == 1 or keras.backend.backend() != "tensorflow":
        return

    def notice_checkpoint() -> None:
        checkpoint = _checkpoint_creating_its_save_counter()
        if checkpoint is not None:
            override(checkpoint, "_write", _once_from_the_chief(replicas, checkpoint._write))

    variable_creation.watch(notice_checkpoint)


def save_counter_code() -> Any:
    """The code of `tf.train.Checkpoint._maybe_create_save_counter` (TensorFlow's own,
    private; the canary is tests/test_script_saves.py::test_save_counter_code)."""
    from tensorflow.python.checkpoint import checkpoint

    return checkpoint.Checkpoint._maybe_create_save_counter.__code__


def _checkpoint_creating_its_save_counter() -> Any:
    """The `tf.train.Checkpoint` whose save counter is being created, if that is what the
    stack shows."""
    target = save_counter_code()
    frame = sys._getframe(2)
    while frame is not None and frame.f_code is not target:
        frame = frame.f_back
    return None if frame is None else frame.f_locals.get("self")


def _once_from_the_chief(replicas: "Replicas", tensorflow_write: Any) -> Any:
    def write(file_prefix: Any, options: Any = None) -> Any:
        if not isinstance(file_prefix, (str, os.PathLike)) or "://" in os.fspath(file_prefix):
            # A tensor (graph mode), or a path TensorFlow's own file layer writes: as TensorFlow does.
            return tensorflow_write(file_prefix, options=options)
        path = os.path.abspath(os.fspath(file_prefix))
        directory, name = os.path.split(path)
        # One series per directory and name: `save` numbers its files (ckpt-1, ckpt-2), and a
        # manager deletes old ones, so the record is on the directory, not on a file.
        series = re.sub(r"-\d+$", "", name)
        return written_once(replicas, os.path.join(directory, series), CommitRecord.in_directory(path, directory, series),
                            lambda: tensorflow_write(file_prefix, options=options), elsewhere=os.fspath(file_prefix))

    return write
