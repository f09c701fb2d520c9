"""Backups that do not stall training: the state is copied to host memory between steps, written in a thread.

Writing a `.weights.h5` costs the chief the time to encode and write every variable, and a
backup every few steps would hold every process at the next collective while it does.
Here the save's step only copies the variables' values to host memory (`WeightsSnapshot`:
Keras's own saving walk, into memory), and a thread writes them in Keras's format and
commits them atomically (`keras_dist.fault_tolerance.atomic_writes`), as Orbax's asynchronous
checkpointer does. One write per backup at a time: a new backup waits for the previous
one, and the end of `fit` or a stop at the preemption notice waits for the last.
"""

import threading
from collections.abc import Callable

import keras
import numpy as np

from keras_dist import keras_internals


class BackgroundWrite:
    """Runs one write at a time in a thread; the write's error is raised where it is next waited for."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, write: Callable[[], None]) -> None:
        """Waits for the previous write, then starts `write` in a thread."""
        self.wait()

        def run() -> None:
            try:
                write()
            except BaseException as exc:  # raised in the training thread by `wait`
                self._error = exc

        # Not a daemon: a process that ends while a backup is written finishes writing it.
        self._thread = threading.Thread(target=run, name="keras_dist-backup-write")
        _PENDING.add(self)
        self._thread.start()

    def wait(self) -> None:
        """Returns once no write is under way; raises the error of the last one, if it failed."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        _PENDING.discard(self)
        if self._error is not None:
            error, self._error = self._error, None
            raise error


# Writes under way in this process (`wait_for_all`).
_PENDING: set[BackgroundWrite] = set()


def wait_for_all() -> None:
    """Returns once every backup of this process begun so far is on disk."""
    for write in list(_PENDING):
        write.wait()


class WeightsSnapshot:
    """A host copy of what `model.save_weights` would write, taken by `take` and written by `write`.

    Keras's own saving walk (`saving_lib._save_state`) visits the model's layers,
    optimizer and metrics and hands each variable to its store; the store here keeps a
    host copy of each value, in order, and `write` replays those calls into Keras's own
    H5 store, so the file is the one `save_weights` writes. The walk's collectives, where
    reading a variable is one (MultiWorkerMirrored), happen in `take`, in the training
    thread. The host buffers of one snapshot are reused by the next (taken once the
    previous write is done): allocating fresh memory for every backup costs more than
    the copy.
    """

    def __init__(self) -> None:
        self._entries: list[tuple[str, dict | None, dict[str, np.ndarray]]] = []

    def take(self, model: keras.Model) -> None:
        """Copies the model's saved state to host memory (between two steps)."""
        buffers = {(i, key): value for i, (_, _, values) in enumerate(self._entries) for key, value in values.items()}
        entries: list[tuple[str, dict | None, dict[str, np.ndarray]]] = []

        class HostCopies(keras_internals.h5_io_store()):
            def __init__(self) -> None:  # no file: the entries stay in memory
                self.mode = "w"

            def __bool__(self) -> bool:
                return True

            def make(self, path: str, metadata: dict | None = None) -> "HostCopies":
                entries.append((path, metadata, {}))
                return self

            def __setitem__(self, key: str, value: object) -> None:
                # Into the previous snapshot's buffer, through the variable's array view
                # (TensorFlow's and JAX's on CPU copy nothing): a buffer of fresh memory per
                # backup, or a conversion that allocates one, costs the step several times
                # the copy (bench/results/2026-11-25-cpu-2core-backups.md).
                buffer = buffers.get((len(entries) - 1, key))
                view = np.asarray(value)
                if buffer is None or buffer.shape != view.shape or buffer.dtype != view.dtype:
                    buffer = np.empty_like(view)
                np.copyto(buffer, view)
                entries[-1][2][key] = buffer

        keras_internals.save_state(model, HostCopies())
        self._entries = entries

    def write(self, path: str) -> None:
        """Writes the copy to `path` as a Keras `.weights.h5` file."""
        store = keras_internals.h5_io_store()(path, mode="w")
        try:
            for entry_path, metadata, values in self._entries:
                entry = store.make(entry_path, metadata=metadata)
                for key, value in values.items():
                    entry[key] = value
        finally:
            store.close()
