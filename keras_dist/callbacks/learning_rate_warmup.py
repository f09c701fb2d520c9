"""Linear learning-rate warmup for large global batches."""

import keras

from keras_dist import keras_internals


class LearningRateWarmup(keras.callbacks.Callback):
    """Ramps the learning rate linearly up to its compiled value over the first epochs.

    Scaling the learning rate by the number of replicas (`keras_dist.compile(...,
    scale_learning_rate=True)`) keeps the per-example step size when the global batch
    grows, but large early steps can diverge; the ramp starts at the unscaled rate
    (compiled rate / replicas) and reaches the compiled rate after `warmup_epochs`.
    It updates the rate every batch and needs a float learning rate, not a schedule.

    Args:
        warmup_epochs: length of the ramp, in epochs (fractions allowed).
        start_factor: rate at the start of the ramp, as a fraction of the compiled rate;
            default `1 / num_replicas`.
        verbose: 1 prints the rate at the end of the ramp (chief only).

    Example:

    ```python
    keras_dist.compile(model, optimizer="sgd", loss="mse", scale_learning_rate=True)
    model.fit(x, y, epochs=10, callbacks=[keras_dist.callbacks.LearningRateWarmup(2)])
    ```
    """

    def __init__(self, warmup_epochs: float = 1.0, start_factor: float | None = None, verbose: int = 0) -> None:
        super().__init__()
        self.warmup_epochs = warmup_epochs
        self.start_factor = start_factor
        self.verbose = verbose
        self._target = None
        self._epoch = 0
        self._done = False
        self._first_batch = True
        self._is_chief = True

    def on_train_begin(self, logs: dict | None = None) -> None:
        # The strategy keras_dist.compile attached to the model; none: one plain process.
        training = getattr(self.model, "_keras_dist", None)
        self._is_chief = training is None or training.strategy.is_chief
        self._done = False
        self._first_batch = True
        self._target = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        if self.start_factor is None:
            self.start_factor = 1.0 / (1 if training is None else training.strategy.num_replicas)

    def on_epoch_begin(self, epoch: int, logs: dict | None = None) -> None:
        self._epoch = epoch

    def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
        steps = self.params.get("steps") or 1
        progress = min(1.0, (self._epoch + batch / steps) / self.warmup_epochs)
        if self._done:
            return
        if progress >= 1.0 and self._first_batch:
            # Resumed past the ramp (BackupAndRestore): the restored rate, perhaps already
            # decayed by a schedule callback, stands.
            self._done = True
            return
        self._first_batch = False
        factor = self.start_factor + (1 - self.start_factor) * progress
        self.model.optimizer.learning_rate = self._target * factor
        self._done = progress >= 1.0
        if self._done and self.verbose and self._is_chief:
            keras_internals.print_msg(f"LearningRateWarmup: learning rate reached {self._target:g}")
