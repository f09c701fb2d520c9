"""Keep callbacks that write files from running on workers other than the chief."""

import keras

from keras_dist.callbacks.atomic_writes import make_writes_atomic

# Callbacks that write under a user-given path. A user subclass of one counts too.
FILE_WRITING_CALLBACKS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.BackupAndRestore,
    keras.callbacks.TensorBoard,
    keras.callbacks.CSVLogger,
)


def callbacks_for_this_worker(callbacks, backend):
    """The user's callbacks as this worker must run them.

    Args:
        callbacks: a list of callbacks, a `keras.callbacks.CallbackList`, or None.
        backend: the active keras_dist backend.

    Returns:
        A new list. On the chief, every callback, checkpoints written atomically
        (`make_writes_atomic`). On other workers, file-writing callbacks are dropped,
        or, where the backend's saves are collective (every worker must take part in
        a save), redirected to a scratch directory by the backend.
    """
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks = callbacks.callbacks
    callbacks = list(callbacks or [])
    if backend.is_chief:
        return [backend.chief_file_callback(make_writes_atomic(c)) if isinstance(c, FILE_WRITING_CALLBACKS) else c
                for c in callbacks]
    kept = []
    for callback in callbacks:
        if not isinstance(callback, FILE_WRITING_CALLBACKS):
            kept.append(callback)
        elif backend.saves_are_collective:
            kept.append(backend.redirect_to_scratch(callback))
    return kept
