"""`fit`, `evaluate` and `predict` on the chief, each step a closure scheduled on a worker."""

import concurrent.futures
import itertools
import sys
import threading
from collections import deque
from collections.abc import Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from keras_dist import keras_internals, keras_workarounds, network, timeouts
from keras_dist.inputs import tf_data
from keras_dist.strategies.parameter_server import sharded_variables
from keras_dist.strategies.parameter_server.step_watch import Step, StepWatch
from keras_dist.callbacks.batch_logs import reads_batch_logs
from keras_dist.errors import KerasDistError
from keras_dist.logs import flat_logs, metric_results
from keras_dist.settings import Settings


class CoordinatedSteps:
    """`fit`, `evaluate` and `predict` of one compiled model, as closures scheduled on workers.

    Every closure runs Keras's own step function inside a `keras.StatelessScope` whose
    metric states start at zero; it writes the other variables the step assigned back
    to the ps tasks and returns the metric states, which the chief sums. Metric states
    are not accumulated on the ps tasks: Keras 3 updates them with read-then-write,
    which loses updates when workers run at once, and a retried closure would count twice.

    Args:
        model: the compiled model, its variables under `strategy`.
        strategy: the `ParameterServerStrategy`.
        coordinator: its `ClusterCoordinator`.
        workers: the worker tasks' addresses, in task order (their number bounds the
            closures in flight; a stalled step probes them to name a frozen one).
        step_timeout: how long a step may take before the job stops with a one-line error:
            its `first` until a step function has run `timeouts.FIRST_STEPS` times on each
            worker's share, then its `later`; None: the defaults. Timed on a thread of its
            own (`step_watch`), wherever the chief waits.
        stalled: set when a step did not finish in time.
    """

    def __init__(self, model: keras.Model, strategy: tf.distribute.ParameterServerStrategy,
                 coordinator: tf.distribute.coordinator.ClusterCoordinator, workers: Sequence[str] = ("",),
                 step_timeout: timeouts.StepTimeout | None = None, stalled: threading.Event | None = None) -> None:
        self.model = model
        self.step_timeout = step_timeout or timeouts.policy(Settings())
        self.workers = workers
        self.stalled = stalled or threading.Event()
        self._watch = StepWatch(self.step_timeout, len(workers), self._stopped, self.stalled)
        self.strategy = strategy
        self.coordinator = coordinator
        # Enough queued steps to keep every worker busy, few enough that the chief reads
        # ahead of the workers by a handful of batches only.
        self.max_in_flight = 4 * len(workers)
        self._step_functions = {}

    # --- the closures ---------------------------------------------------------
    def _metric_variables(self):
        return [v for m in self.model.metrics for v in m.variables]

    def _step_function(self, kind, per_worker_input=False):
        """A `tf.function` running one `kind` step ("train", "test", "predict") on a worker.

        It takes a batch, or with `per_worker_input` an iterator of a per-worker dataset.
        """
        key = (kind, per_worker_input)
        if key in self._step_functions:
            return self._step_functions[key]
        model = self.model
        step = {"train": model.train_step, "test": model.test_step, "predict": model.predict_step}[kind]
        if any(keras_workarounds.is_sharded(v) for v in model.variables):
            sharded_variables.embedding_lookups_by_shard(model)
            keras_workarounds.sharded_variables_savable(model.variables + (model.optimizer.variables
                                                                           if model.optimizer else []))
            if kind == "train":
                step = sharded_variables.train_step(model)
        metric_variables = self._metric_variables()
        iterations = model.optimizer.iterations if model.optimizer is not None else None
        skipped = {id(v) for v in metric_variables} | {id(iterations)}
        optimizer_variables = model.optimizer.variables if model.optimizer is not None else []
        written = [v for v in model.variables + optimizer_variables if id(v) not in skipped]

        def run_step(data):
            if kind == "predict":
                return step(data)
            zeros = [(v, tf.zeros(v.shape, v.dtype)) for v in metric_variables]
            with keras.StatelessScope(state_mapping=zeros, collect_losses=True) as scope:
                logs = step(data)
            for variable in written:  # BatchNorm statistics, weight constraints
                value = scope.get_current_value(variable)
                if value is not None:
                    variable.assign(value)
            if kind == "train" and iterations is not None:
                iterations.value.assign_add(1)  # atomic on the ps, unlike Keras's read-then-write
            return [scope.get_current_value(v) for v in metric_variables], logs if isinstance(logs, dict) else {}

        if per_worker_input:
            function = tf.function(lambda iterator: self.strategy.run(run_step, args=(next(iterator),)))
        else:
            function = tf.function(lambda data: self.strategy.run(run_step, args=(data,)))
        self._step_functions[key] = function
        return function

    def _build(self, batch, kind):
        """Creates the variables a `kind` step uses before the first closure (none may create them)."""
        with self.strategy.scope():
            if kind == "predict":
                if not self.model.built:
                    keras_internals.compute_output_spec(self.model, batch)
            else:
                keras_internals.symbolic_build(self.model, batch)

    def _results(self, fetched):
        """Logs of a run from its steps' `(metric states, step logs)`, in step order.

        As in Keras: the metrics' results over all steps, computed from the summed
        states, unless a custom step returns other keys; then the keys of the last
        step's logs, with the metrics' results where names match (a step's own states
        start at zero, so its values cover that step only).
        """

        states = [np.zeros(v.shape, v.dtype) for v in self._metric_variables()]
        for step_states, _ in fetched:
            states = [total + np.asarray(part) for total, part in zip(states, step_states)]
        results = metric_results(self.model.metrics, states)
        step_logs = flat_logs(fetched[-1][1]) if fetched else {}
        if fetched and set(step_logs) != set(results):
            results = {name: results.get(name, value) for name, value in step_logs.items()}
        return {name: float(value) if np.ndim(value) == 0 else np.asarray(value) for name, value in results.items()}

    def _value(self, step: Step, function, args, attempts=3):
        """The value of a finished step, running it again if its worker died before handing it over.

        A closure's result stays on its worker until fetched; TensorFlow retries closures
        that fail, not results lost afterwards. A training batch rerun here trains twice,
        as one whose worker died mid-update does under TensorFlow's own retry. A step
        unfinished after the step timeout (a frozen or stalled worker, which TensorFlow
        would wait for forever) stops the job with a one-line error (`StepWatch`): running
        it elsewhere does not help, as the coordinator's thread for that worker then
        blocks the chief's next eager operation (seen here: `evaluate` hung after `fit`
        had gone on without the frozen worker).
        """
        from tensorflow.python.distribute.coordinator.cluster_coordinator import _is_worker_failure

        for attempt in range(attempts):
            try:
                return self._watch.value(step)
            except tf.errors.OpError as error:
                if not _is_worker_failure(error) or attempt == attempts - 1:
                    raise
            step = self._watch.add(self.coordinator.schedule(function, args=args), function, oldest=True)

    def _stopped(self, remote):
        """Names the workers that no longer answer, else the one running `remote`'s step.

        The late step is not always the frozen worker's: others' steps can wait behind
        it (a frozen worker 1 leaves worker 0's step unfinished too). Called on the
        watch's thread.
        """
        with concurrent.futures.ThreadPoolExecutor(len(self.workers)) as pool:
            serving = list(pool.map(network.serves, self.workers))
        frozen = [f"/job:worker/task:{i} ({address})" for i, (address, up) in enumerate(zip(self.workers, serving))
                  if not up]
        if frozen:
            return frozen
        worker = _worker_running(remote)
        return [] if worker is None else [f"/job:worker/task:{worker} ({self.workers[worker]})"]

    def _run(self, function, inputs, callbacks, hooks):
        """Runs `function` on each input as closures, a bounded number in flight; returns their values.

        Batch hooks: `begin` as a step is scheduled, `end` (with empty logs: results
        are remote until the epoch ends) as its value arrives.
        """
        begin, end = hooks
        values, in_flight = [], deque()

        def collect_oldest():
            step, watched, args = in_flight.popleft()
            values.append(self._value(watched, function, args))
            getattr(callbacks, end)(step, {})

        for step, args in enumerate(inputs):
            getattr(callbacks, begin)(step)
            in_flight.append((step, self._watch.add(self.coordinator.schedule(function, args=args), function), args))
            if len(in_flight) >= self.max_in_flight:
                collect_oldest()
            if self.model.stop_training:
                break
        while in_flight:
            collect_oldest()
        return values

    # --- inputs ---------------------------------------------------------------
    @staticmethod
    def _adapter(x, y, sample_weight, batch_size, steps, shuffle, class_weight=None):
        """Keras's data adapter over inputs the chief reads (arrays, datasets)."""
        if isinstance(x, tf.data.Dataset) and steps is None and x.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise KerasDistError("the dataset is infinite: pass steps_per_epoch (fit), validation_steps or steps "
                                 "(evaluate/predict) under backend 'parameter_server'")
        return keras_internals.get_data_adapter(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps,
                                                shuffle=shuffle, class_weight=class_weight)

    @staticmethod
    def _first_batch(dataset):
        for batch in dataset.take(1):
            return batch
        raise KerasDistError("the input has no batches; check that x is not empty")

    # --- fit ------------------------------------------------------------------
    def fit(self, x: Any = None, y: Any = None, batch_size: int | None = None, epochs: int = 1,
            verbose: str | int = "auto", callbacks: Sequence[keras.callbacks.Callback] | None = None,
            validation_split: float = 0.0, validation_data: Any = None, shuffle: bool = True,
            class_weight: dict[int, float] | None = None, sample_weight: Any = None, initial_epoch: int = 0,
            steps_per_epoch: int | None = None, validation_steps: int | None = None,
            validation_batch_size: int | None = None, validation_freq: int = 1) -> keras.callbacks.History:
        model = self.model
        if validation_split:
            raise KerasDistError("validation_split needs NumPy arrays under backend 'parameter_server'; "
                                 "pass validation_data instead")
        iterator, dataset = self._training_input(x, y, sample_weight, batch_size, steps_per_epoch, shuffle,
                                                 class_weight)
        per_worker_input = iterator is not None
        function = self._step_function("train", per_worker_input)
        verbose = 1 if verbose == "auto" else verbose
        steps = steps_per_epoch or (None if per_worker_input else _known_length(dataset))
        callbacks = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                                 verbose=verbose, epochs=epochs, steps=steps, model=model)
        refuse_batch_log_readers(callbacks)
        model.stop_training = False
        callbacks.on_train_begin()
        initial_epoch = keras_internals.initial_epoch(model) or initial_epoch
        batches, logs = None, None
        for epoch in range(initial_epoch, epochs):
            callbacks.on_epoch_begin(epoch)
            if per_worker_input:
                inputs = itertools.repeat((iterator,), steps_per_epoch)
            else:
                # With steps_per_epoch an epoch goes on where the last one stopped, as in Keras.
                if batches is None or steps_per_epoch is None:
                    batches = iter(dataset)
                inputs = ((batch,) for batch in itertools.islice(batches, steps_per_epoch))
            step_states = self._run(function, inputs, callbacks, ("on_train_batch_begin", "on_train_batch_end"))
            if not per_worker_input and steps_per_epoch is not None and len(step_states) < steps_per_epoch:
                batches = None  # ran out: the next epoch starts the input again
            logs = self._results(step_states)
            if validation_data is not None and keras_internals.should_evaluate(model, epoch, validation_freq):
                logs.update(self._validation_logs(validation_data, validation_batch_size or batch_size,
                                                  validation_steps, callbacks))
            callbacks.on_epoch_end(epoch, logs)
            if model.stop_training:
                break
        if isinstance(model.optimizer, keras.optimizers.Optimizer) and epochs > 0:
            model.optimizer.finalize_variable_values(model.trainable_weights)
        callbacks.on_train_end(logs)
        return model.history

    def _training_input(self, x: Any, y: Any, sample_weight: Any, batch_size: int | None,
                        steps_per_epoch: int | None, shuffle: bool, class_weight: Any) -> tuple[Any, Any]:
        """What `fit`'s epochs read, with the model built for it: (an iterator over the workers'
        own input, None) where every worker builds its input (a dataset function, or a pipeline
        TensorFlow sends them), else (None, the dataset the coordinator reads)."""
        model = self.model
        dataset_function = callable(x) and not isinstance(x, tf.data.Dataset)
        if not dataset_function and not _rebuildable_on_workers(x, steps_per_epoch):
            dataset = self._adapter(x, y, sample_weight, batch_size, steps_per_epoch, shuffle,
                                    class_weight).get_tf_dataset()
            self._build(self._first_batch(dataset), "train")
            return None, dataset
        if steps_per_epoch is None:
            raise KerasDistError("a dataset function is built on every worker and has no known length; "
                                 "pass steps_per_epoch to fit")
        if dataset_function:
            iterator = iter(self.coordinator.create_per_worker_dataset(
                lambda: self.strategy.distribute_datasets_from_function(x)))
        else:  # TensorFlow sends the pipeline's graph to every worker, which reads and preprocesses
            iterator = iter(self.coordinator.create_per_worker_dataset(x))
        if not model.built or not model.optimizer.built:
            self._build(self._first_batch(x(tf.distribute.InputContext()) if dataset_function else x), "train")
        return iterator, None

    def _validation_logs(self, validation_data: Any, batch_size: int | None, steps: int | None,
                         callbacks: keras.callbacks.CallbackList) -> dict[str, Any]:
        """The epoch's validation, as `val_` logs."""
        val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data) \
            if isinstance(validation_data, tuple) else (validation_data, None, None)
        val_logs = self.evaluate(val_x, val_y, batch_size=batch_size, sample_weight=val_weight, steps=steps,
                                 verbose=0, callbacks=callbacks, return_dict=True)
        return {f"val_{k}": v for k, v in val_logs.items()}

    # --- evaluate and predict ---------------------------------------------------
    def _run_chief_batches(self, kind, x, y, sample_weight, batch_size, steps, callbacks, verbose):
        if callable(x) and not isinstance(x, tf.data.Dataset):
            x = x(tf.distribute.InputContext())  # read by the chief: exact, in order
        dataset = self._adapter(x, y, sample_weight, batch_size, steps, shuffle=False).get_tf_dataset()
        if steps is not None:
            dataset = dataset.take(steps)
        self._build(self._first_batch(dataset), kind)
        if not isinstance(callbacks, keras.callbacks.CallbackList):
            verbose = 1 if verbose == "auto" else verbose
            callbacks = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                                                     steps=steps or _known_length(dataset), model=self.model)
        refuse_batch_log_readers(callbacks)
        hooks = ("on_test_batch_begin", "on_test_batch_end") if kind == "test" else \
            ("on_predict_batch_begin", "on_predict_batch_end")
        return callbacks, lambda: self._run(self._step_function(kind), ((b,) for b in dataset), callbacks, hooks)

    def evaluate(self, x: Any = None, y: Any = None, batch_size: int | None = None, verbose: str | int = "auto",
                 sample_weight: Any = None, steps: int | None = None,
                 callbacks: Sequence[keras.callbacks.Callback] | keras.callbacks.CallbackList | None = None,
                 return_dict: bool = False, **kwargs: Any) -> float | np.ndarray | list[Any] | dict[str, Any]:
        if kwargs:
            raise KerasDistError(f"evaluate got unknown arguments {sorted(kwargs)}; remove them")
        callbacks, run = self._run_chief_batches("test", x, y, sample_weight, batch_size, steps, callbacks, verbose)
        callbacks.on_test_begin()
        logs = self._results(run())
        callbacks.on_test_end(logs)
        return logs if return_dict else keras_internals.metrics_in_order(self.model, logs)

    def predict(self, x: Any, batch_size: int | None = None, verbose: str | int = "auto", steps: int | None = None,
                callbacks: Sequence[keras.callbacks.Callback] | keras.callbacks.CallbackList | None = None) -> Any:
        callbacks, run = self._run_chief_batches("predict", x, None, None, batch_size, steps, callbacks, verbose)
        callbacks.on_predict_begin()
        outputs = run()
        callbacks.on_predict_end()
        return keras.tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *outputs)


def _worker_running(remote):
    """The index of the worker running the closure behind `remote`, or None.

    TensorFlow does not say; each worker's closure loop runs on a thread of the chief,
    so the one whose `_process_closure` holds this closure is it.
    """
    threads = {t.ident: t.name for t in threading.enumerate() if t.name.startswith("WorkerClosureProcessingLoop-")}
    for ident, frame in sys._current_frames().items():
        if ident not in threads:
            continue
        while frame is not None:
            closure = frame.f_locals.get("closure") if frame.f_code.co_name == "_process_closure" else None
            if closure is not None and closure.maybe_call_with_output_remote_value(lambda value: value is remote):
                return int(threads[ident].rsplit("-", 1)[1])
            frame = frame.f_back
    return None


def _rebuildable_on_workers(x, steps_per_epoch):
    """Whether `fit` can have each worker build its own copy of dataset `x`.

    Only an endless dataset (it repeats) with `steps_per_epoch`: epochs are counted in
    steps, so copies on several workers change nothing but who preprocesses. A finite
    one is read by the chief, which trains each batch once per epoch. A pipeline that
    runs Python (`from_generator`, `py_function`) cannot travel to the workers.
    """
    if not isinstance(x, tf.data.Dataset) or steps_per_epoch is None or x.cardinality() != tf.data.INFINITE_CARDINALITY:
        return False
    return not tf_data.runs_python(x)


def _known_length(dataset):
    """Batches in `dataset`, or None when TensorFlow cannot tell (the loop then runs it out)."""
    count = int(dataset.cardinality())
    return count if count >= 0 else None


def refuse_batch_log_readers(callbacks: keras.callbacks.CallbackList) -> None:
    """One-line error for a callback that needs per-batch logs, which exist only per epoch.

    Steps run asynchronously on the workers; batch hooks are called as steps are
    scheduled (`*_batch_begin`) and complete (`*_batch_end`, with empty logs). Hooks that
    do not read logs (a learning-rate ramp in `on_train_batch_begin`) work.

    Args:
        callbacks: a `keras.callbacks.CallbackList`.
    """
    for callback in callbacks.callbacks:
        if reads_batch_logs(callback):
            raise KerasDistError(
                f"{type(callback).__name__} reads per-batch logs, which backend 'parameter_server' has only at the end "
                "of each epoch (steps run asynchronously); use epoch-level hooks or save_freq/update_freq='epoch'"
            )
