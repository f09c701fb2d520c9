"""Runs one compiled model's `fit`, `evaluate` and `predict` on the active backend.

`attach` replaces those three methods on the model object only (no Keras class is
patched). Each wrapper splits the inputs, adjusts callbacks and verbosity for this
worker, then calls Keras's own method, so every Keras argument keeps its meaning.
Where the backend reduces in keras_dist (Horovod), `get_metrics_result` is wrapped too:
Keras calls it at the end of every epoch and evaluation, and inside the train step, so
summing metric states across processes there makes every log global, on every worker.
Inside the train step it costs a collective per step, so it is done only where a
callback reads per-batch logs; otherwise batch logs (the progress bar's running values)
are this worker's own and epoch logs global.
"""

import contextlib
import inspect
import warnings

import tensorflow as tf

from keras_dist import runtime, sharding
from keras_dist.callbacks.batch_logs import TRAIN_BATCH_HOOKS, reads_batch_logs
from keras_dist.callbacks.chief_only import callbacks_for_this_worker
from keras_dist.callbacks.sync_state import SyncInitialState, sync_model_state
from keras_dist.errors import KerasDistError

_INPUT_NAMES = ("x", "y", "sample_weight")


class DistributedTraining:
    """The per-model state behind the wrapped methods."""

    def __init__(self, model, backend):
        self.model = model
        self.backend = backend
        self.keras_fit = model.fit
        self.keras_evaluate = model.evaluate
        self.keras_predict = model.predict
        self.keras_get_metrics_result = model.get_metrics_result
        self.in_fit = False
        self.in_evaluate = False
        self.synced = False
        # Whether the train function (traced once) sums metric states in every step.
        self.global_batch_logs = True

    # --- inputs ---------------------------------------------------------------
    @property
    def num_shards(self):
        return self.backend.input_plan.num_shards

    def _split(self, args, pad, batch_key="batch_size", steps_key="steps", purpose="evaluate"):
        """Replaces x/y/sample_weight in `args` with this process's shard."""
        plan = self.backend.input_plan
        x = args.get("x")
        if isinstance(x, tf.data.Dataset):
            if plan.num_shards > 1 and args.get(steps_key) is None and x.cardinality() == tf.data.INFINITE_CARDINALITY:
                raise KerasDistError(f"the dataset is infinite (it repeats); pass {steps_key} to {purpose}")
            # With a step count the epoch ends there; without, shards are padded to equal steps.
            args["x"] = sharding.shard_dataset(x, plan.num_shards, plan.shard_index, pad and args.get(steps_key) is None,
                                               plan.batch_multiplier, files=purpose != "predict",
                                               allgather=self.backend.allgather_object)
        elif x is not None and sharding.is_array_input(x):
            arrays = {k: args[k] for k in _INPUT_NAMES if k in args}
            args.update(sharding.shard_arrays(arrays, plan.num_shards, plan.shard_index, pad))
            if args.get(batch_key) is not None:
                args[batch_key] *= plan.batch_multiplier
        elif plan.num_shards > 1:
            raise KerasDistError(
                f"keras_dist cannot split a {type(x).__name__} across {plan.num_shards} processes; "
                "pass NumPy arrays or a tf.data.Dataset"
            )
        else:
            return
        if not pad and plan.collective_steps:
            args["x"] = sharding.open_ended(args if sharding.is_array_input(args["x"]) else args["x"], args.get(batch_key))
            args.update({k: None for k in ("y", "sample_weight", batch_key) if k in args})

    def _split_validation(self, args):
        if args.get("validation_split") and args.get("validation_data") is None and sharding.is_array_input(args.get("x")):
            # Split before sharding, as Keras would on one process: the last fraction.
            arrays = {k: args.get(k) for k in _INPUT_NAMES}
            length = len(next(a for a in arrays.values() if a is not None))
            cut = int(length * (1.0 - args["validation_split"]))
            args.update({k: None if a is None else a[:cut] for k, a in arrays.items()})
            args["validation_data"] = tuple(None if a is None else a[cut:] for a in arrays.values())
            args["validation_split"] = 0.0
        validation = args.get("validation_data")
        if validation is None:
            return
        if isinstance(validation, tf.data.Dataset):
            val = {"x": validation}
        else:
            val = dict(zip(_INPUT_NAMES, validation))
        val["batch_size"] = args.get("validation_batch_size") or args.get("batch_size")
        val["steps"] = args.get("validation_steps")
        self._split(val, pad=False)
        args["validation_data"] = val["x"] if isinstance(val["x"], tf.data.Dataset) else tuple(val.get(k) for k in _INPUT_NAMES)
        if args.get("validation_batch_size") is not None:
            args["validation_batch_size"] = val["batch_size"]

    # --- wrapped methods --------------------------------------------------------
    def _worker_args(self, method, args, kwargs):
        bound = inspect.signature(method).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop("kwargs", {})
        arguments.update(extra)
        arguments["callbacks"] = callbacks_for_this_worker(arguments.get("callbacks"), self.backend)
        if not self.backend.is_chief:
            arguments["verbose"] = 0
        return arguments

    def fit(self, *args, **kwargs):
        arguments = self._worker_args(self.keras_fit, args, kwargs)
        if self.backend.reduces_in_keras_dist:
            self._choose_batch_logs(arguments["callbacks"])
        self._split_validation(arguments)
        self._split(arguments, pad=True, steps_key="steps_per_epoch", purpose="fit")
        if self.backend.size > 1:
            arguments["callbacks"].append(SyncInitialState(self.backend))
        with self._flag("in_fit"):
            history = self.backend.run_loop("fit", self.model, self.keras_fit, arguments)
        self.synced = True
        return history

    def evaluate(self, *args, **kwargs):
        if self.in_fit:  # validation inside fit: inputs already split
            with self._flag("in_evaluate"):
                return self.keras_evaluate(*args, **kwargs)
        arguments = self._worker_args(self.keras_evaluate, args, kwargs)
        self._split(arguments, pad=False)
        self._sync_once()
        with self._flag("in_evaluate"), self._quiet_end_of_open_ended_input():
            return self.backend.run_loop("evaluate", self.model, self.keras_evaluate, arguments)

    def predict(self, *args, **kwargs):
        arguments = self._worker_args(self.keras_predict, args, kwargs)
        self._split(arguments, pad=False, purpose="predict")
        self._sync_once()
        with self._quiet_end_of_open_ended_input():
            outputs = self.backend.run_loop("predict", self.model, self.keras_predict, arguments)
        if self.num_shards == 1:
            return outputs
        return sharding.gather_interleaved(self.backend, outputs, self.num_shards)

    def _choose_batch_logs(self, callbacks):
        """Sums metric states in every train step only if some worker's callback reads batch logs."""
        local = any(reads_batch_logs(c, TRAIN_BATCH_HOOKS) for c in callbacks)
        # Agreed by all: a step's collectives must match on every worker.
        needed = any(self.backend.allgather_object(local)) if self.backend.size > 1 else local
        if needed != self.global_batch_logs:
            self.global_batch_logs = needed
            self.model.train_function = None  # traced again with the other choice

    def get_metrics_result(self):
        """Model metrics computed from their states summed over every process.

        Inside the compiled test step it stays local: evaluation shards may differ by one
        batch across processes, so only the final, eager call reduces. Inside the train
        step it stays local unless a callback reads batch logs (`_choose_batch_logs`).
        """
        if tf.inside_function() and (self.in_evaluate or (self.in_fit and not self.global_batch_logs)):
            return self.keras_get_metrics_result()
        metrics = self.model.metrics
        states = [v.value for m in metrics for v in m.variables]
        if not states:
            return self.keras_get_metrics_result()
        return metric_results(metrics, self.backend.sum_across_processes_in_graph(states))

    def _sync_once(self):
        if not self.synced and self.backend.size > 1:
            sync_model_state(self.model, self.backend)
            self.synced = True

    @contextlib.contextmanager
    def _quiet_end_of_open_ended_input(self):
        # Keras warns "Your input ran out of data" where an open-ended input ends as planned.
        with warnings.catch_warnings():
            if self.backend.input_plan.collective_steps:
                warnings.filterwarnings("ignore", message="Your input ran out of data")
            yield

    @contextlib.contextmanager
    def _flag(self, name):
        previous = getattr(self, name)
        setattr(self, name, True)
        try:
            yield
        finally:
            setattr(self, name, previous)


def metric_results(metrics, states):
    """`{name: value}` of `metrics` computed from `states`, their variables' values in order.

    Args:
        metrics: `model.metrics`.
        states: one value per metric variable, e.g. states summed over replicas.
    """
    states = list(states)
    results = {}
    for metric in metrics:
        count = len(metric.variables)
        result = metric.stateless_result(states[:count])
        states = states[count:]
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results


def distribute_dataset(dataset, training=True):
    """This process's share of `dataset`, as keras_dist's `fit` (or `evaluate`) reads it.

    For loops of your own, and to see what each worker reads: a batched dataset whose
    batch size is per replica, split as described in `keras_dist.sharding`.

    Args:
        dataset: a batched `tf.data.Dataset`, the same on every process.
        training: pad the shards to equal length, as `fit` does (collective; every
            process must call it).

    Example:

    ```python
    for x, y in keras_dist.distribute_dataset(dataset):
        ...
    ```
    """
    backend = runtime.current()
    plan = backend.input_plan
    return sharding.shard_dataset(dataset, plan.num_shards, plan.shard_index, training, plan.batch_multiplier,
                                  allgather=backend.allgather_object)


def attach(model, backend):
    """Makes `model.fit/evaluate/predict` run distributed on `backend`."""
    training = DistributedTraining(model, backend)
    overrides = ["fit", "evaluate", "predict"]
    if backend.reduces_in_keras_dist:
        overrides.append("get_metrics_result")
    for name in overrides:
        # object.__setattr__: bypass Keras's attribute tracking, these are not state.
        object.__setattr__(model, name, getattr(training, name))
    object.__setattr__(model, "_keras_dist", training)
    return training
