"""Runs one compiled model's `fit`, `evaluate` and `predict` on the active backend.

`attach` replaces those three methods on the model object only (no Keras class is
patched). Each wrapper splits the inputs, adjusts callbacks and verbosity for this
worker, then calls Keras's own method, so every Keras argument keeps its meaning.
Under several processes Keras's choice of epoch logs (`_get_metrics_result_or_logs`,
called at the end of every epoch and evaluation) is wrapped too: summing metric states
across processes there makes every epoch log global, on every worker. Backends that
reduce in keras_dist (Horovod, PyTorch) also sum them inside the train step
(`get_metrics_result`) where a callback reads per-batch logs (a collective per step);
otherwise batch logs (the progress bar's running values) are this worker's.
"""

import contextlib
import inspect
import os
import warnings

import keras
import numpy as np
from keras import tree

from keras_dist import optimizer_hooks, runtime, sharding
from keras_dist.callbacks.batch_logs import TRAIN_BATCH_HOOKS, reads_batch_logs
from keras_dist.callbacks.chief_only import callbacks_for_this_worker
from keras_dist.callbacks.replica_check import ReplicaCheck
from keras_dist.callbacks.sync_state import SyncInitialState, sync_model_state
from keras_dist.errors import KerasDistError
from keras_dist.overrides import override, set_while

_INPUT_NAMES = ("x", "y", "sample_weight")


class DistributedTraining:
    """The per-model state behind the wrapped methods."""

    def __init__(self, model, backend, gradient_options):
        self.model = model
        self.backend = backend
        self.gradient_options = gradient_options
        self.distributed_optimizers = {id(o) for o in optimizer_hooks.optimizers_of(model)}
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
        if sharding.is_tf_dataset(x):
            from keras_dist import tf_data_sharding

            if plan.num_shards > 1 and args.get(steps_key) is None and tf_data_sharding.is_infinite(x):
                raise KerasDistError(f"the dataset is infinite (it repeats); pass {steps_key} to {purpose}")
            # With a step count the epoch ends there; without, shards are padded to equal steps.
            args["x"] = tf_data_sharding.shard_dataset(x, plan.num_shards, plan.shard_index, pad and args.get(steps_key) is None,
                                               plan.batch_multiplier, files=purpose != "predict",
                                               allgather=self.backend.allgather_object)
        elif isinstance(x, keras.utils.PyDataset):
            if plan.num_shards > 1 or plan.batch_multiplier > 1:
                args["x"] = sharding.ShardedPyDataset(x, plan.num_shards, plan.shard_index, pad, plan.batch_multiplier,
                                                      contiguous=purpose == "predict",
                                                      equal_steps=pad or plan.collective_steps)
            return  # collective steps already end together (`equal_steps`)
        elif sharding.is_data_loader(x):
            if plan.num_shards > 1 or plan.batch_multiplier > 1:
                args["x"] = self._split_data_loader(x, plan, pad)
            return
        elif x is not None and sharding.is_array_input(x):
            arrays = {k: args[k] for k in _INPUT_NAMES if k in args}
            args.update(sharding.shard_arrays(arrays, plan.num_shards, plan.shard_index, pad))
            if args.get(batch_key) is not None:
                args[batch_key] *= plan.batch_multiplier
        elif plan.num_shards > 1:
            raise KerasDistError(
                f"keras_dist cannot split a {type(x).__name__} across {plan.num_shards} processes; "
                "pass NumPy arrays, a tf.data.Dataset, a keras.utils.PyDataset or a torch DataLoader"
            )
        else:
            return
        if not pad and plan.collective_steps:
            from keras_dist import tf_data_sharding

            args["x"] = tf_data_sharding.open_ended(args if sharding.is_array_input(args["x"]) else args["x"], args.get(batch_key))
            args.update({k: None for k in ("y", "sample_weight", batch_key) if k in args})

    def _split_data_loader(self, loader, plan, pad):
        from keras_dist import data_loader_sharding

        if data_loader_sharding.is_split(loader):
            return loader  # by the script, with a DistributedSampler
        if plan.collective_steps:
            raise KerasDistError(f"backend {self.backend.name!r} cannot read a torch DataLoader (its steps are "
                                 "collectives); pass NumPy arrays, a tf.data.Dataset or a keras.utils.PyDataset")
        # One seed for every process's permutations, drawn anew for each call.
        seed = self.backend.broadcast_object(int.from_bytes(os.urandom(4), "little")) \
            if data_loader_sharding.shuffles(loader) else None
        return data_loader_sharding.shard_data_loader(loader, plan.num_shards, plan.shard_index, pad,
                                                      plan.batch_multiplier, seed)

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
        # As Keras reads it: a tuple is (x, y[, sample_weight]); anything else (a dataset, a
        # PyDataset, a DataLoader) yields its own batches.
        val = dict(zip(_INPUT_NAMES, validation)) if isinstance(validation, (tuple, list)) else {"x": validation}
        val["batch_size"] = args.get("validation_batch_size") or args.get("batch_size")
        val["steps"] = args.get("validation_steps")
        self._split(val, pad=False)
        args["validation_data"] = val["x"] if not sharding.is_array_input(val["x"]) else tuple(val.get(k) for k in _INPUT_NAMES)
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
        self._distribute_new_optimizers()
        arguments = self._worker_args(self.keras_fit, args, kwargs)
        if self.backend.reduces_in_keras_dist:
            self._choose_batch_logs(arguments["callbacks"])
        self._split_validation(arguments)
        self._split(arguments, pad=True, steps_key="steps_per_epoch", purpose="fit")
        if self.backend.size > 1:
            # First at each epoch end, before user callbacks save; last at the start, after they restore.
            arguments["callbacks"] = [ReplicaCheck(self.backend), *arguments["callbacks"], SyncInitialState(self.backend)]
        with self._flag("in_fit"):
            history = self.backend.run_loop("fit", self.model, self.keras_fit, arguments)
        self.synced = True
        return history

    def evaluate(self, *args, **kwargs):
        local_steps = self.backend.process_local_steps(self.model)
        if self.in_fit:  # validation inside fit: inputs already split
            with self._flag("in_evaluate"), local_steps:
                return self.keras_evaluate(*args, **kwargs)
        arguments = self._worker_args(self.keras_evaluate, args, kwargs)
        self._split(arguments, pad=False)
        self._sync_once()
        with self._flag("in_evaluate"), self._quiet_end_of_open_ended_input(), local_steps:
            return self.backend.run_loop("evaluate", self.model, self.keras_evaluate, arguments)

    def predict(self, *args, **kwargs):
        arguments = self._worker_args(self.keras_predict, args, kwargs)
        self._split(arguments, pad=False, purpose="predict")
        self._sync_once()
        with self._quiet_end_of_open_ended_input(), self.backend.process_local_steps(self.model):
            outputs = self.backend.run_loop("predict", self.model, self.keras_predict, arguments)
        if self.num_shards == 1:
            return outputs
        if isinstance(arguments["x"], sharding.ShardedPyDataset):  # consecutive batches: in rank order
            return tree.map_structure(lambda leaf: self.backend.allgather_array(np.asarray(leaf)), outputs)
        return sharding.gather_interleaved(self.backend, outputs, self.num_shards)

    def _distribute_new_optimizers(self):
        """Optimizers the model took after compile (`model.g_optimizer = ...`) reduce too."""
        for optimizer in optimizer_hooks.optimizers_of(self.model):
            if id(optimizer) not in self.distributed_optimizers:
                self.backend.distribute_optimizer(optimizer, self.gradient_options)
                self.distributed_optimizers.add(id(optimizer))

    def _choose_batch_logs(self, callbacks):
        """Sums metric states in every train step only if some worker's callback reads batch logs."""
        local = any(reads_batch_logs(c, TRAIN_BATCH_HOOKS) for c in callbacks)
        # Agreed by all: a step's collectives must match on every worker.
        needed = any(self.backend.allgather_object(local)) if self.backend.size > 1 else local
        if needed != self.global_batch_logs:
            self.global_batch_logs = needed
            self.model.train_function = None  # traced again with the other choice

    def get_metrics_result(self):
        """Model metrics, as Keras's steps inside `fit` and `evaluate`, or the script, ask for them.

        Inside `fit` and `evaluate` the callers are steps (compiled, or eager as on
        PyTorch): the states stay this process's, except in the train step of a backend
        that reduces them itself (Horovod, PyTorch) where a callback reads batch logs
        (`_choose_batch_logs`). Evaluation shards may differ by one batch across
        processes, so a test step never reduces. Epoch and evaluation ends come through
        `get_metrics_result_or_logs`; the script's own calls get the global results.
        """
        if not (self.in_fit or self.in_evaluate):
            return self.global_metrics_result()
        variables = [v for m in self.model.metrics for v in m.variables]
        if not variables or not self.backend.reduces_in_keras_dist or self.in_evaluate or not self.global_batch_logs:
            return self.keras_get_metrics_result()
        return metric_results(self.model.metrics, self.backend.sum_across_processes_in_step([v.value for v in variables]))

    def global_metrics_result(self):
        """Model metrics computed from their states over every process (`Strategy.global_metric_states`)."""
        metrics = self.model.metrics
        variables = [v for m in metrics for v in m.variables]
        if not variables:
            return self.keras_get_metrics_result()
        return metric_results(metrics, self.backend.global_metric_states(variables))

    def get_metrics_result_or_logs(self, logs):
        """Epoch logs: the global metric results, and the other keys of a custom step's logs averaged.

        Keras takes the metrics' results only where the last step's logs have exactly
        their keys, else the step's own (this worker's) values; a custom `train_step`
        returning `{m.name: m.result() for m in self.metrics}` nests the compiled
        metrics in a dict, so its keys never match. Here nested logs are flattened, and
        values that are not metrics are averaged over processes, so every worker logs
        the same.
        """
        metric_logs = self.global_metrics_result()
        if not isinstance(logs, dict):
            return metric_logs
        flat = flat_logs(logs)
        if set(flat) == set(metric_logs):
            return metric_logs
        others = sorted(k for k in flat if k not in metric_logs)
        means = self.backend.sum_arrays([np.asarray(keras.ops.convert_to_numpy(flat[k]), np.float64) for k in others])
        return {**{k: metric_logs[k] for k in flat if k in metric_logs},
                **{k: float(total) / self.backend.size for k, total in zip(others, means)}}

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

    def _flag(self, name):
        return set_while(self, name, True)


def flat_logs(logs):
    """Logs with nested dicts (a `CompileMetrics` result) merged in, as Keras shows them."""
    flat = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(flat_logs(value))
        else:
            flat[name] = value
    return flat


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
        own, states = states[:count], states[count:]
        result = metric.stateless_result(own)
        # A `result()` that returns a state variable itself escapes stateless_result's mapping.
        by_variable = {id(v): value for v, value in zip(metric.variables, own)}
        result = tree.map_structure(lambda r: by_variable.get(id(r), r), result)
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
    from keras_dist import tf_data_sharding

    backend = runtime.current()
    plan = backend.input_plan
    return tf_data_sharding.shard_dataset(dataset, plan.num_shards, plan.shard_index, training, plan.batch_multiplier,
                                  allgather=backend.allgather_object)


def attach(model, backend, gradient_options):
    """Makes `model.fit/evaluate/predict` run distributed on `backend`."""
    training = DistributedTraining(model, backend, gradient_options)
    names = ["fit", "evaluate", "predict"]
    if backend.size > 1 and backend.runs_keras_loops:  # Keras's own loops read logs
        names += ["get_metrics_result", "_get_metrics_result_or_logs"]
    for name in names:
        override(model, name, getattr(training, name.lstrip("_")))
    override(model, "_keras_dist", training)
    return training
