"""Which callbacks read per-batch logs: those logs cost a collective per step to make global."""

from collections.abc import Iterable

import keras

from keras_dist.keras_internals import is_default

TRAIN_BATCH_HOOKS = ("on_batch_end", "on_train_batch_end")
ALL_BATCH_HOOKS = TRAIN_BATCH_HOOKS + ("on_test_batch_end", "on_predict_batch_end")


def reads_batch_logs(callback: keras.callbacks.Callback, hooks: Iterable[str] = ALL_BATCH_HOOKS) -> bool:
    """Whether `callback` reads the logs its `hooks` are given, in its configuration.

    Keras's progress bar and History, and ModelCheckpoint, BackupAndRestore and
    TensorBoard set to save or write per epoch, leave their batch hooks idle; any other
    callback that overrides one of `hooks` counts as reading.
    """
    if not any(not is_default(getattr(callback, hook)) for hook in hooks):
        return False
    if isinstance(callback, (keras.callbacks.ProgbarLogger, keras.callbacks.History)):
        return False
    if isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
        return getattr(callback, "save_freq", "epoch") not in ("epoch", False)
    if isinstance(callback, keras.callbacks.TensorBoard):
        return callback.update_freq != "epoch"  # Keras 3 has no batch profiling
    return True
