"""A file-writing callback run against a scratch directory, for collective saves.

Under MultiWorkerMirroredStrategy a save is a collective: every worker must take part,
so workers other than the chief save into a scratch directory of their own, removed when
the run ends (or, where a worker was killed, by the next run on the machine).
"""

import copy
import glob
import os
import shutil
import tempfile
import weakref

import keras

from keras_dist.fault_tolerance.atomic_writes import keras_own_saves
from keras_dist.keras_internals import callback_model, is_default
from keras_dist.launchers.processes import process_ended
from keras_dist.overrides import restore

_SCRATCH_PREFIX = "keras_dist_scratch_"


def _remove_scratch_of_ended_processes():
    """Removes scratch directories (whole model copies) that killed processes left behind."""
    for path in glob.glob(os.path.join(tempfile.gettempdir(), _SCRATCH_PREFIX + "*_*")):
        pid = os.path.basename(path)[len(_SCRATCH_PREFIX):].split("_", 1)[0]
        if pid.isdigit() and process_ended(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


class ScratchCallback(keras.callbacks.Callback):
    """Runs a copy of a file-writing callback against a temporary directory.

    MultiWorkerMirroredStrategy saves are collective, so every worker must save; non-chief
    workers write into a scratch directory that is removed when the run ends.

    Args:
        callback: a `ModelCheckpoint`, `BackupAndRestore`, `TensorBoard` or `CSVLogger`.

    Example:

    ```python
    callbacks = [ScratchCallback(keras.callbacks.ModelCheckpoint("best.keras"))]
    ```
    """

    _PATH_ATTRIBUTES = ("filepath", "backup_dir", "log_dir", "filename")

    def __init__(self, callback: keras.callbacks.Callback) -> None:
        super().__init__()
        _remove_scratch_of_ended_processes()
        self.directory = tempfile.mkdtemp(prefix=f"{_SCRATCH_PREFIX}{os.getpid()}_")
        # Also gone when the run fails or the process exits without reaching the end.
        weakref.finalize(self, shutil.rmtree, self.directory, True)
        model = callback_model(callback)
        self.inner = copy.deepcopy(callback, {id(model): model} if model is not None else {})
        restore(self.inner)  # replaced methods would still write through the original
        for name in self._PATH_ATTRIBUTES:
            original = getattr(self.inner, name, None)
            if isinstance(original, (str, os.PathLike)):
                self._move(os.fspath(original))
        self._training = False

    def _move(self, original):
        replacement = os.path.join(self.directory, os.path.basename(original.rstrip(os.sep)) or "out")
        for name, value in vars(self.inner).items():
            if isinstance(value, str) and value.startswith(original):
                setattr(self.inner, name, replacement + value[len(original):])

    def set_model(self, model: keras.Model) -> None:
        super().set_model(model)
        self.inner.set_model(model)

    def set_params(self, params: dict) -> None:
        super().set_params(params)
        self.inner.set_params(params)

    def __getattribute__(self, name):
        # Every `on_*` hook goes to the copy, saving with Keras's own methods (the scratch copy
        # is this worker's alone); cleanup follows the end of the run.
        if name.startswith("on_") and name not in ("on_train_begin", "on_train_end", "on_test_end", "on_predict_end"):
            hook = getattr(object.__getattribute__(self, "inner"), name)
            if is_default(hook):  # Keras tells idle batch hooks apart by this
                return hook
            model = object.__getattribute__(self, "inner").model

            def with_keras_own_saves(*args, **kwargs):
                with keras_own_saves(model):
                    return hook(*args, **kwargs)
            return with_keras_own_saves
        return object.__getattribute__(self, name)

    def on_train_begin(self, logs: dict | None = None) -> None:
        self._training = True
        with keras_own_saves(self.model):
            self.inner.on_train_begin(logs)

    def on_train_end(self, logs: dict | None = None) -> None:
        with keras_own_saves(self.model):
            self.inner.on_train_end(logs)
        self._training = False
        self._remove()

    def on_test_end(self, logs: dict | None = None) -> None:
        with keras_own_saves(self.model):
            self.inner.on_test_end(logs)
        if not self._training:
            self._remove()

    def on_predict_end(self, logs: dict | None = None) -> None:
        with keras_own_saves(self.model):
            self.inner.on_predict_end(logs)
        self._remove()

    def _remove(self):
        shutil.rmtree(self.directory, ignore_errors=True)
