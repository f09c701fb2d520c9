"""Parameter-server training: `tf.distribute.ParameterServerStrategy` driven by `ClusterCoordinator`.

Keras 3 has no parameter-server support (keras-team/keras#18624), so this backend runs
`fit`, `evaluate` and `predict` itself, on the chief, with Keras's own `train_step`,
`test_step` and `predict_step` executed on the workers as scheduled closures. Worker and
ps tasks only serve: `import keras_dist` turns them into TensorFlow servers and never
returns, so one unchanged script runs on every task.

Training is asynchronous: each closure reads the variables on the ps tasks, computes
one batch's update and applies it, while other workers do the same.
"""

import json
import os
import sys

import keras
import numpy as np
import tensorflow as tf

from keras_dist.backends.base import Backend, GradientOptions
from keras_dist.backends.tf_strategy import adopt_optimizer, move_variables
from keras_dist.errors import KerasDistError
from keras_dist.tf_cluster import loopback_binding_env, parse_tf_config, prepare_server_process

_SERVING_TASKS = ("worker", "ps")


def _ps_cluster(environ):
    """`(cluster, task_type, index)` of a TF_CONFIG that lists ps tasks, with one-line errors."""
    cluster, kind, index = parse_tf_config(environ.get("TF_CONFIG", ""))
    if not cluster.get("ps") or not cluster.get("worker"):
        raise KerasDistError("backend 'parameter_server' needs TF_CONFIG with 'ps' and 'worker' tasks; "
                             "launch with `keras-dist launch --backend parameter_server -n WORKERS --ps K`")
    if len(cluster.get("chief", [])) != 1:
        raise KerasDistError("backend 'parameter_server' needs exactly one 'chief' task in TF_CONFIG: "
                             "it runs the script and schedules the steps")
    return cluster, kind, index


def serve(cluster, kind, index):
    """Runs this process as TF_CONFIG's `kind:index` server until it is killed.

    Args:
        cluster: TF_CONFIG's cluster dict.
        kind: "worker" or "ps".
        index: the task index.
    """
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=kind, task_index=index,
                                  protocol="grpc", start=True)
    print(f"keras_dist: {kind}:{index} serving at {cluster[kind][index]} for the chief", file=sys.stderr, flush=True)
    server.join()


class ParameterServerBackend(Backend):
    """Asynchronous training with variables on parameter servers.

    Selected when TF_CONFIG lists `ps` tasks. Launch with
    `keras-dist launch --backend parameter_server -n WORKERS --ps K train.py`, or set
    TF_CONFIG on each task of a cluster with one `chief`, `worker` and `ps` tasks. The
    chief runs the script; workers and ps tasks serve from `import keras_dist` on.

    Inputs: NumPy arrays and `tf.data` datasets are read by the chief and each batch is
    trained exactly once per epoch by whichever worker is free; a dataset function
    (`fn(input_context) -> tf.data.Dataset`) is built on every worker instead and needs
    `steps_per_epoch`. `evaluate` and `predict` count every example exactly once,
    even when a worker is lost mid-way.

    Variables are placed whole, round-robin over the ps tasks. TensorFlow's variable
    partitioners are not offered: a partitioned variable (`ShardedVariable`) has no
    single handle, and Keras 3's `train_step` differentiates through one per variable.

    Example:

    ```python
    ctx = keras_dist.init()  # on the chief; worker and ps tasks never get here
    print(ctx.name, ctx.num_replicas)  # parameter_server, the number of workers
    ```
    """

    name = "parameter_server"

    @classmethod
    def detect(cls, environ) -> bool:
        text = environ.get("TF_CONFIG")
        if not text:
            return False
        try:
            return bool(json.loads(text)["cluster"].get("ps"))
        except (ValueError, KeyError, TypeError, AttributeError):
            return False  # not ours: the multi-worker backend reports what is wrong

    @classmethod
    def prepare_process(cls, environ) -> None:
        cluster, kind, index = _ps_cluster(environ)
        prepare_server_process(environ)
        if kind in _SERVING_TASKS:
            serve(cluster, kind, index)
            sys.exit(0)
        # The coordinator retries a step on another worker only if RPCs fail fast.
        environ.setdefault("GRPC_FAIL_FAST", "use_caller")
        # Connecting moves this process's devices into the cluster and invalidates variables
        # made before; connect now, so models the script builds before compile stay valid.
        tf.config.experimental_connect_to_cluster(tf.distribute.cluster_resolver.TFConfigClusterResolver(),
                                                  job_name="chief")

    @classmethod
    def local_tasks(cls, num_workers, num_ps, argv):
        from keras_dist.launcher import Task, free_loopback_ports

        if num_ps < 1:
            raise KerasDistError("backend 'parameter_server' needs at least one parameter server; add --ps 1")
        ports = iter(free_loopback_ports(1 + num_workers + num_ps))
        cluster = {"chief": [f"127.0.0.1:{next(ports)}"],
                   "worker": [f"127.0.0.1:{next(ports)}" for _ in range(num_workers)],
                   "ps": [f"127.0.0.1:{next(ports)}" for _ in range(num_ps)]}
        loopback = loopback_binding_env(os.environ, "127.0.0.1")
        return [
            Task(f"{kind}:{i}", [sys.executable, *argv], serves=kind != "chief",
                 env={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}}), **loopback})
            for kind in ("chief", "worker", "ps") for i in range(len(cluster[kind]))
        ]

    def __init__(self):
        cluster, kind, _ = _ps_cluster(os.environ)
        if kind != "chief":
            raise KerasDistError(f"TF_CONFIG task {kind!r} serves under backend 'parameter_server'; "
                                 "only the 'chief' task runs the script past `import keras_dist`")
        self.num_workers = len(cluster["worker"])
        self.strategy = tf.distribute.ParameterServerStrategy(tf.distribute.cluster_resolver.TFConfigClusterResolver())
        self.coordinator = tf.distribute.coordinator.ClusterCoordinator(self.strategy)
        self._steps = {}  # model id -> CoordinatedSteps

    @property
    def num_replicas(self) -> int:
        return self.num_workers

    def scope(self):
        return self.strategy.scope()

    def prepare_model(self, model):
        move_variables(model, self.strategy)
        return model

    def distribute_optimizer(self, optimizer, options: GradientOptions) -> None:
        if options.reduction != "mean" or options.compression:
            raise KerasDistError("backend 'parameter_server' applies each worker's gradients as they come; "
                                 "drop gradient_reduction and gradient_compression")
        adopt_optimizer(optimizer, self.strategy)

    def describe(self) -> dict:
        return {**super().describe(), "workers": self.num_workers, "strategy": "ParameterServerStrategy"}

    def run_loop(self, method, model, keras_method, arguments):
        steps = self._steps.get(id(model))
        if steps is None:
            steps = self._steps[id(model)] = CoordinatedSteps(model, self.strategy, self.coordinator)
        try:
            return getattr(steps, method)(**arguments)
        except (tf.errors.UnavailableError, tf.errors.AbortedError, tf.errors.CancelledError) as exc:
            raise KerasDistError(_lost_task_message(exc)) from None


def _lost_task_message(exc):
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
    return (f"a parameter server or the cluster became unreachable ({first}); restart the job: "
            "the chief resumes from its last BackupAndRestore checkpoint")


class CoordinatedSteps:
    """`fit`, `evaluate` and `predict` of one model, as closures scheduled on workers.

    Every closure runs Keras's own step function. Metric states are not accumulated on
    the ps tasks (Keras 3 updates them with read-then-write, which loses updates when
    workers run at once, and a retried closure would count twice): each closure starts
    them at zero in a `keras.StatelessScope`, returns them, and the chief sums what the
    completed closures returned.

    Args:
        model: the compiled model, its variables under `strategy`.
        strategy: the `ParameterServerStrategy`.
        coordinator: its `ClusterCoordinator`.
    """

    def __init__(self, model, strategy, coordinator):
        self.model = model
        self.strategy = strategy
        self.coordinator = coordinator
        self._functions = {}

    # --- the closures ---------------------------------------------------------
    def _metric_variables(self):
        return [v for m in self.model.metrics for v in m.variables]

    def _closure(self, kind):
        """A `tf.function` running one step of `kind` ("train", "test", "predict") on a worker."""
        if kind in self._functions:
            return self._functions[kind]
        model = self.model
        step = {"train": model.train_step, "test": model.test_step, "predict": model.predict_step}[kind]
        metric_variables = self._metric_variables()
        metric_ids = {id(v) for v in metric_variables}
        iterations = model.optimizer.iterations if model.optimizer is not None else None
        # Variables a step may assign besides metric states (BatchNorm statistics, loss scale).
        written = [v for v in model.non_trainable_variables + (model.optimizer.variables if model.optimizer else [])
                   if id(v) not in metric_ids and v is not iterations]

        def run_step(data):
            if kind == "predict":
                return step(data)
            zeros = [(v, tf.zeros(v.shape, v.dtype)) for v in metric_variables]
            with keras.StatelessScope(state_mapping=zeros) as scope:
                step(data)
            for variable in written:
                value = scope.get_current_value(variable)
                if value is not None:
                    variable.assign(value)
            if kind == "train" and iterations is not None:
                iterations.value.assign_add(1)  # atomic on the ps, unlike Keras's read-then-write
            return [scope.get_current_value(v) for v in metric_variables]

        @tf.function
        def per_batch(data):
            return self.strategy.run(run_step, args=(data,))

        @tf.function
        def from_iterator(iterator):
            return self.strategy.run(run_step, args=(next(iterator),))

        self._functions[kind] = (per_batch, from_iterator)
        return self._functions[kind]

    def _build(self, batch):
        """Creates every variable (model, optimizer, compiled metrics) before the first closure."""
        with self.strategy.scope():
            self.model._symbolic_build(data_batch=batch)
            if self.model.optimizer is not None and not self.model.optimizer.built:
                self.model.optimizer.build(self.model.trainable_variables)

    def _results(self, remote_states):
        from keras_dist.training import metric_results

        states = [np.sum([np.asarray(s[i]) for s in remote_states], axis=0) for i in range(len(self._metric_variables()))]
        if not remote_states:
            states = [np.asarray(v.numpy()) * 0 for v in self._metric_variables()]
        return {k: float(np.asarray(v)) for k, v in metric_results(self.model.metrics, states).items()}

    # --- inputs ---------------------------------------------------------------
    def _chief_batches(self, x, y, sample_weight, batch_size, steps, shuffle, class_weight=None):
        """A Keras data adapter over inputs the chief reads (arrays, datasets)."""
        from keras.src.trainers.data_adapters import get_data_adapter

        if isinstance(x, tf.data.Dataset) and steps is None and x.cardinality() == tf.data.INFINITE_CARDINALITY:
            raise KerasDistError("the dataset is infinite: pass steps_per_epoch (fit), validation_steps or steps "
                                 "(evaluate/predict) under backend 'parameter_server'")
        adapter = get_data_adapter(x, y, sample_weight, batch_size=batch_size, steps_per_epoch=steps,
                                   shuffle=shuffle, class_weight=class_weight)
        return adapter

    @staticmethod
    def _take(adapter, steps):
        dataset = adapter.get_tf_dataset()
        return dataset.take(steps) if steps is not None else dataset

    # --- fit ------------------------------------------------------------------
    def fit(self, x=None, y=None, batch_size=None, epochs=1, verbose="auto", callbacks=None, validation_split=0.0,
            validation_data=None, shuffle=True, class_weight=None, sample_weight=None, initial_epoch=0,
            steps_per_epoch=None, validation_steps=None, validation_batch_size=None, validation_freq=1):
        model = self.model
        if validation_split:
            raise KerasDistError("validation_split needs NumPy arrays under backend 'parameter_server'; "
                                 "pass validation_data instead")
        per_worker = callable(x) and not isinstance(x, tf.data.Dataset)
        if per_worker:
            if steps_per_epoch is None:
                raise KerasDistError("a dataset function is built on every worker and has no known length; "
                                     "pass steps_per_epoch to fit")
            iterator = iter(self.coordinator.create_per_worker_dataset(
                lambda: self.strategy.distribute_datasets_from_function(x)))
            self._build(next(iter(x(tf.distribute.InputContext()))))
        else:
            adapter = self._chief_batches(x, y, sample_weight, batch_size, steps_per_epoch, shuffle, class_weight)
            steps_per_epoch = steps_per_epoch or adapter.num_batches
            self._build(next(iter(adapter.get_tf_dataset())))
        per_batch, from_iterator = self._closure("train")
        verbose = 1 if verbose == "auto" else verbose
        callbacks = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0,
                                                 verbose=verbose, epochs=epochs, steps=steps_per_epoch, model=model)
        refuse_batch_log_readers(callbacks)
        model.stop_training = False
        callbacks.on_train_begin()
        initial_epoch = model._initial_epoch or initial_epoch
        logs = None
        for epoch in range(initial_epoch, epochs):
            callbacks.on_epoch_begin(epoch)
            batches = None if per_worker else iter(self._take(adapter, steps_per_epoch))
            scheduled = []
            for step in range(steps_per_epoch):
                if batches is None:
                    closure, args = from_iterator, (iterator,)
                else:
                    batch = next(batches, None)
                    if batch is None:
                        break
                    closure, args = per_batch, (batch,)
                callbacks.on_train_batch_begin(step)
                scheduled.append(self.coordinator.schedule(closure, args=args))
                callbacks.on_train_batch_end(step, {})
                if model.stop_training:
                    break
            self.coordinator.join()
            logs = self._results([r.fetch() for r in scheduled])
            if validation_data is not None and (epoch + 1) % validation_freq == 0:
                val_x, val_y, val_weight = keras.utils.unpack_x_y_sample_weight(validation_data) \
                    if isinstance(validation_data, tuple) else (validation_data, None, None)
                val = self.evaluate(val_x, val_y, batch_size=validation_batch_size or batch_size,
                                    sample_weight=val_weight, steps=validation_steps, verbose=0, return_dict=True)
                logs.update({f"val_{k}": v for k, v in val.items()})
            callbacks.on_epoch_end(epoch, logs)
            if model.stop_training:
                break
        callbacks.on_train_end(logs)
        return model.history

    # --- evaluate and predict ---------------------------------------------------
    def _schedule_batches(self, kind, x, y, sample_weight, batch_size, steps, callbacks, verbose):
        if callable(x) and not isinstance(x, tf.data.Dataset):
            x = x(tf.distribute.InputContext())  # read by the chief: exact, in order
        adapter = self._chief_batches(x, y, sample_weight, batch_size, steps, shuffle=False)
        dataset = self._take(adapter, steps)
        first = next(iter(dataset), None)
        if first is None:
            return [], None
        if kind == "test":
            self._build(first)
        else:
            self._build(first if isinstance(first, tuple) else (first,))
        per_batch, _ = self._closure(kind)
        verbose = 1 if verbose == "auto" else verbose
        callbacks = keras.callbacks.CallbackList(callbacks, add_progbar=verbose != 0, verbose=verbose, epochs=1,
                                                 steps=steps or adapter.num_batches, model=self.model)
        refuse_batch_log_readers(callbacks)
        begin, end = ("on_test_begin", "on_test_end") if kind == "test" else ("on_predict_begin", "on_predict_end")
        getattr(callbacks, begin)()
        scheduled = [self.coordinator.schedule(per_batch, args=(batch,)) for batch in dataset]
        self.coordinator.join()
        return [r.fetch() for r in scheduled], (callbacks, end)

    def evaluate(self, x=None, y=None, batch_size=None, verbose="auto", sample_weight=None, steps=None,
                 callbacks=None, return_dict=False, **kwargs):
        remote, finish = self._schedule_batches("test", x, y, sample_weight, batch_size, steps, callbacks, verbose)
        logs = self._results(remote)
        if finish:
            callbacks, end = finish
            getattr(callbacks, end)(logs)
        return logs if return_dict else self.model._flatten_metrics_in_order(logs)

    def predict(self, x, batch_size=None, verbose="auto", steps=None, callbacks=None):
        remote, finish = self._schedule_batches("predict", x, None, None, batch_size, steps, callbacks, verbose)
        if finish:
            callbacks, end = finish
            getattr(callbacks, end)()
        if not remote:
            raise KerasDistError("predict got no input batches; check that x is not empty")
        return keras.tree.map_structure(lambda *parts: np.concatenate([np.asarray(p) for p in parts]), *remote)


# Keras callbacks whose batch hooks do nothing with the logs in the configuration given.
def _epoch_only(callback):
    if isinstance(callback, (keras.callbacks.ProgbarLogger, keras.callbacks.History)):
        return True
    if isinstance(callback, (keras.callbacks.ModelCheckpoint, keras.callbacks.BackupAndRestore)):
        return getattr(callback, "save_freq", "epoch") in ("epoch", False)
    if isinstance(callback, keras.callbacks.TensorBoard):
        return callback.update_freq == "epoch" and not getattr(callback, "_profile_batch", 0)
    return False


def refuse_batch_log_readers(callbacks):
    """One-line error for a callback that needs per-batch logs, which arrive only per epoch.

    Steps run asynchronously on the workers; batch hooks are called as steps are
    scheduled, with empty logs. Hooks that do not read logs (a learning-rate ramp in
    `on_train_batch_begin`) work.
    """
    base = keras.callbacks.Callback
    for callback in callbacks.callbacks:
        reads_logs = any(getattr(type(callback), hook) is not getattr(base, hook)
                         for hook in ("on_train_batch_end", "on_test_batch_end", "on_predict_batch_end"))
        if reads_logs and not _epoch_only(callback):
            raise KerasDistError(
                f"{type(callback).__name__} reads per-batch logs, which backend 'parameter_server' has only at the end "
                "of each epoch (steps run asynchronously); use epoch-level hooks or save_freq/update_freq='epoch'"
            )

