"""Runs one compiled model's `fit`, `evaluate` and `predict` on the active strategy.

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
import itertools
import logging
import warnings
from typing import TYPE_CHECKING, Any

import keras

from keras_dist import inputs, optimizer_hooks, optimizer_sharding
from keras_dist.errors import KerasDistError, first_line, is_out_of_memory
from keras_dist.logs import flat_logs, metric_results
from keras_dist.fault_tolerance import background_writes, resume, script_saves
from keras_dist.fault_tolerance.preemption import PreemptionNotice
from keras_dist.inputs.position import EpochPosition
from keras_dist.callbacks.batch_logs import TRAIN_BATCH_HOOKS, reads_batch_logs
from keras_dist.callbacks.file_callbacks import callbacks_for_this_worker, watched
from keras_dist.callbacks.replica_check import ReplicaCheck
from keras_dist.callbacks.sync_state import SyncInitialState, sync_model_state
from keras_dist.overrides import override, set_while

if TYPE_CHECKING:
    from keras_dist.strategies.base import GradientOptions, Strategy

logger = logging.getLogger("keras_dist")
# The fits this process ran: each fit of a script backed up by `--backup-dir` has its own backup.
_FIT_CALLS = itertools.count()


# The order of fit's callbacks, every engine alike: Keras calls each hook in list order.
FIT_CALLBACK_ORDER = (
    "replica_check",  # first at each epoch end: the replicas agree before the script's callbacks save
    "preemption_notice",  # a notice becomes a save at a step every process agrees on
    "resume_point",  # where a backup resumes inside an epoch (without a backup: the epoch followed)
    "the_scripts",  # the script's callbacks as this worker runs them (callbacks_for_this_worker)
    "resume_point_last",  # after them: their state is part of the backup
    "preemption_notice_last",
    "initial_state_sync",  # last at the start: after the script's callbacks restore, the chief's state for all
)


class DistributedTraining:
    """The per-model state behind the wrapped methods."""

    def __init__(self, model: keras.Model, strategy: "Strategy", gradient_options: "GradientOptions") -> None:
        self.model = model
        self.strategy = strategy
        self.gradient_options = gradient_options
        self.distributed_optimizers = {id(o) for o in optimizer_hooks.optimizers_of(model)}
        self.keras_fit = model.fit
        self.keras_evaluate = model.evaluate
        self.keras_predict = model.predict
        self.keras_get_metrics_result = model.get_metrics_result
        self.in_fit = False
        self.in_evaluate = False
        self.synced = False
        # Whether this process evaluates on a stand-in for an empty share (`inputs.Inputs.stand_in`).
        self.stand_in_evaluation = False
        self.stand_in_validation = False
        # Whether the train function (traced once) sums metric states in every step.
        self.global_batch_logs = True

    # --- wrapped methods --------------------------------------------------------
    def _worker_args(self, method, args, kwargs):
        """The call's Keras arguments as this worker runs them, and the script's callbacks."""
        bound = inspect.signature(method).bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        extra = arguments.pop("kwargs", {})
        arguments.update(extra)
        callbacks = arguments.get("callbacks")
        script_callbacks = list(callbacks.callbacks if isinstance(callbacks, keras.callbacks.CallbackList)
                                else callbacks or [])
        arguments["callbacks"] = callbacks_for_this_worker(script_callbacks, self.strategy,
                                                           self.gradient_options.shard is not None,
                                                           fit=method == self.keras_fit)
        if not self.strategy.is_chief:
            arguments["verbose"] = 0
        return arguments, script_callbacks

    def _split_fit_inputs(self, arguments: dict, position: EpochPosition | None) -> None:
        """Puts this process's share of fit's input and validation in `arguments` (`inputs.fit`)."""
        data, validation = inputs.fit(self.strategy, _read(arguments, "steps_per_epoch"), arguments["validation_data"],
                                      arguments["validation_split"], arguments["validation_batch_size"],
                                      arguments["validation_steps"], position, arguments["shuffle"])
        _write(arguments, data, "steps_per_epoch")
        if data.ordered:
            arguments["shuffle"] = False
        self.stand_in_validation = validation is not None and validation.stand_in
        if validation is not None:
            arguments.update(validation_data=inputs.as_validation_data(validation), validation_split=0.0)
            if arguments["validation_batch_size"] is not None:
                arguments["validation_batch_size"] = validation.batch_size

    def fit(self, *args: Any, **kwargs: Any) -> keras.callbacks.History:
        self._distribute_new_optimizers()
        arguments, script_callbacks = self._worker_args(self.keras_fit, args, kwargs)
        if self.strategy.reduces_in_keras_dist:
            self._choose_batch_logs(arguments["callbacks"])
        backup, automatic = self._backup(arguments, script_callbacks)
        # Notices and resuming inside an epoch need Keras's loop (a parameter server's own
        # loop resumes at the epoch).
        keras_loop = self.strategy.runs_keras_loops
        chosen = self.strategy.settings
        # keras_dist draws the epochs' orders wherever a backup may resume inside an epoch, and
        # wherever several processes read: each epoch's shards are then parts of one global
        # permutation, not fixed strides of the data (issue 47).
        orders = keras_loop and (backup is not None or self.strategy.input_plan.num_shards > 1)
        position = (EpochPosition(seed=inputs.job_seed(self.strategy), elastic=chosen.elastic)
                    if orders else None)
        # One process without a backup keeps the signals' own effect, as without keras_dist.
        notice = None
        if keras_loop and (position is not None or self.strategy.size > 1):
            notice = PreemptionNotice(self.strategy, chosen.backup_seconds if automatic else None)
        self._split_fit_inputs(arguments, position)
        if chosen.elastic and self.strategy.is_chief and (position is None or position.resizable is None):
            _say_fit_cannot_resize()
        arguments["callbacks"] = self._around_the_scripts_callbacks(arguments["callbacks"], backup, position, notice)
        resumes = resume.resume_inside_epoch(self.model, position) if backup is not None and position else contextlib.nullcontext()
        with self._flag("in_fit"), resumes, watched(self.strategy):
            try:
                history = self.strategy.run_loop("fit", self.model, self.keras_fit, arguments)
            except Exception as exc:
                if self.strategy.size > 1 and is_out_of_memory(exc):
                    raise self._out_of_memory(exc) from None
                raise
            finally:
                # Where fit raised, Keras skips `on_train_end`: the backup written in the
                # background is complete before the script, or a rerun in this process, reads it.
                background_writes.wait_for_all()
        if self.strategy.size > 1:
            # The chief's checkpoints are committed before any process goes on: a script that
            # loads the best one right after fit reads the same file everywhere (issue 46).
            self.strategy.collectives.barrier()
        self.synced = True
        return history

    def _backup(self, arguments: dict, script_callbacks: list) -> tuple[Any, bool]:
        """The fit's `BackupAndRestore`: the script's, else one of `--backup-dir` (added to the
        fit's callbacks), else None; and whether it is the automatic one."""
        call = next(_FIT_CALLS)
        backup = resume.backup_of(script_callbacks)
        chosen = self.strategy.settings
        automatic = backup is None and self.strategy.runs_keras_loops and chosen.backup_dir is not None
        if automatic:
            backup = resume.automatic_backup(chosen.backup_dir, call)
            script_callbacks.append(backup)
            arguments["callbacks"] += callbacks_for_this_worker([backup], self.strategy,
                                                                self.gradient_options.shard is not None)
        if chosen.restart and self.strategy.is_chief and backup is None:
            logger.warning("keras_dist: this is restart %s of the job and fit has no keras.callbacks.BackupAndRestore, "
                           "so training starts over; run with keras-dist launch --backup-dir DIR (or add one) to "
                           "resume where the job failed", chosen.restart)
        return backup, automatic

    def _around_the_scripts_callbacks(self, callbacks: list, backup: Any,
                                      position: EpochPosition | None, notice: PreemptionNotice | None) -> list:
        """The fit's callbacks with keras_dist's around them, in `FIT_CALLBACK_ORDER`; a part
        that does not apply to this fit is empty."""
        point = None
        if position is not None and backup is not None:
            runs_backup = resume.backup_of(callbacks)
            # The counters restored are those of the callbacks this process runs (a stand-in's copy).
            point = resume.ResumePoint(self.strategy, runs_backup or backup, position, callbacks,
                                       runs_backup is not None, notice)
        several = self.strategy.size > 1
        parts = {
            "replica_check": [ReplicaCheck(self.strategy)] if several else [],
            "preemption_notice": [notice] if notice is not None else [],
            "resume_point": [point] if point is not None else [resume.FollowEpochs(position)] if position else [],
            "the_scripts": callbacks,
            "resume_point_last": [point.last] if point is not None else [],
            "preemption_notice_last": [notice.last] if notice is not None else [],
            "initial_state_sync": [SyncInitialState(self.strategy)] if several else [],
        }
        return [callback for name in FIT_CALLBACK_ORDER for callback in parts[name]]

    def _out_of_memory(self, error: Exception) -> KerasDistError:
        """The one line for a process that ran out of memory in fit, naming what holds less."""
        fix = ("run more processes (each keeps 1/N of the optimizer's state) or a smaller batch"
               if self.gradient_options.shard is not None and self.strategy.shards_optimizer_state else
               "keras_dist.compile(model, ..., shard='optimizer') keeps 1/N of the optimizer's state on each of N "
               "processes (docs/sharding.md), or train with a smaller batch"
               if self.strategy.shards_optimizer_state else "train with a smaller batch or a smaller model")
        return KerasDistError(f"rank {self.strategy.rank} ran out of memory in fit ({first_line(error)}); {fix}")

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        local_steps = self.strategy.process_local_steps(self.model)
        if self.in_fit:  # validation inside fit: inputs already split
            with self._flag("in_evaluate"), set_while(self, "stand_in_evaluation", self.stand_in_validation), \
                    self._quiet_end_of_open_ended_input(), local_steps:
                return self.keras_evaluate(*args, **kwargs)
        arguments, _ = self._worker_args(self.keras_evaluate, args, kwargs)
        data = inputs.evaluate(self.strategy, _read(arguments, "steps"))
        _write(arguments, data, "steps")
        self._sync_once()
        with self._flag("in_evaluate"), set_while(self, "stand_in_evaluation", data.stand_in), \
                self._quiet_end_of_open_ended_input(), local_steps:
            return self.strategy.run_loop("evaluate", self.model, self.keras_evaluate, arguments)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        arguments, _ = self._worker_args(self.keras_predict, args, kwargs)
        data = inputs.predict(self.strategy, _read(arguments, "steps"))
        _write(arguments, data, "steps")
        self._sync_once()
        with self._quiet_end_of_open_ended_input(), self.strategy.process_local_steps(self.model):
            outputs = self.strategy.run_loop("predict", self.model, self.keras_predict, arguments)
        if data.stand_in:  # outputs of a stand-in for an empty share are not this process's
            outputs = keras.tree.map_structure(lambda leaf: leaf[:0], outputs)
        return inputs.gather_predictions(self.strategy, data, outputs)

    def _distribute_new_optimizers(self):
        """Optimizers the model took after compile (`model.g_optimizer = ...`) reduce too."""
        for optimizer in optimizer_hooks.optimizers_of(self.model):
            if id(optimizer) not in self.distributed_optimizers:
                self.strategy.distribute_optimizer(optimizer, self.gradient_options)
                self.distributed_optimizers.add(id(optimizer))

    def _choose_batch_logs(self, callbacks):
        """Sums metric states in every train step only if some worker's callback reads batch logs."""
        local = any(reads_batch_logs(c, TRAIN_BATCH_HOOKS) for c in callbacks)
        # Agreed by all: a step's collectives must match on every worker.
        needed = any(self.strategy.collectives.allgather_object(local)) if self.strategy.size > 1 else local
        if needed != self.global_batch_logs:
            self.global_batch_logs = needed
            self.model.train_function = None  # traced again with the other choice

    def get_metrics_result(self) -> dict[str, Any]:
        """Model metrics, as Keras's steps inside `fit` and `evaluate`, or the script, ask for them.

        Inside `fit` and `evaluate` the callers are steps (compiled, or eager as on
        PyTorch): the states stay this process's, except in the train step of a strategy
        that reduces them itself (Horovod, PyTorch) where a callback reads batch logs
        (`_choose_batch_logs`). Evaluation shards may differ by one batch across
        processes, so a test step never reduces. Epoch and evaluation ends come through
        `get_metrics_result_or_logs`; the script's own calls get the global results.
        """
        if not (self.in_fit or self.in_evaluate):
            return self.global_metrics_result()
        variables = [v for m in self.model.metrics for v in m.variables]
        if not variables or not self.strategy.reduces_in_keras_dist or self.in_evaluate or not self.global_batch_logs:
            return self.keras_get_metrics_result()
        return metric_results(self.model.metrics, self.strategy.metric_states.sum_in_step([v.value for v in variables]))

    def global_metrics_result(self) -> dict[str, Any]:
        """Model metrics computed from their states over every process (`MetricStates.global_values`)."""
        metrics = self.model.metrics
        variables = [v for m in metrics for v in m.variables]
        if not variables:
            return self.keras_get_metrics_result()
        if self.in_evaluate and self.stand_in_evaluation:
            self.model.reset_metrics()  # the stand-in sample is not this process's to count
        return metric_results(metrics, self.strategy.metric_states.global_values(variables))

    def get_metrics_result_or_logs(self, logs: dict | None) -> dict[str, Any]:
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
        means = self.strategy.collectives.mean_arrays([keras.ops.convert_to_numpy(flat[k]) for k in others])
        return {**{k: metric_logs[k] for k in flat if k in metric_logs},
                **{k: float(mean) for k, mean in zip(others, means)}}

    def _sync_once(self):
        if not self.synced and self.strategy.size > 1:
            sync_model_state(self.model, self.strategy)
            self.synced = True

    @contextlib.contextmanager
    def _quiet_end_of_open_ended_input(self):
        # Keras warns "Your input ran out of data" where an open-ended input ends as planned.
        with warnings.catch_warnings():
            if self.strategy.input_plan.collective_steps:
                warnings.filterwarnings("ignore", message="Your input ran out of data")
            yield

    def _flag(self, name):
        return set_while(self, name, True)


def _say_fit_cannot_resize() -> None:
    """Said at fit's start in an elastic job, while every machine is there, not at the restart that would need it."""
    logger.warning("keras_dist: this elastic job (--nnodes MIN:MAX) cannot resume this fit on another number of "
                   "processes, and a restart on fewer or more machines stops in one line: keras_dist resumes "
                   "%s. Pass one of those, or use a fixed --nnodes", resume.RESIZABLE_INPUTS)


def _read(arguments: dict, steps: str) -> inputs.Inputs:
    """The input among a call's Keras arguments, its step bound named `steps`."""
    return inputs.Inputs(arguments["x"], arguments.get("y"), arguments.get("sample_weight"),
                         arguments["batch_size"], arguments[steps], class_weight=arguments.get("class_weight"))


def _write(arguments: dict, data: inputs.Inputs, steps: str) -> None:
    """Puts `data` back among the call's Keras arguments (`predict` takes no y or sample_weight)."""
    arguments.update((k, v) for k, v in data.arguments(steps).items() if k in arguments)


def attach(model: keras.Model, strategy: "Strategy", gradient_options: "GradientOptions") -> DistributedTraining:
    """Makes `model.fit/evaluate/predict` run distributed on `strategy`."""
    training = DistributedTraining(model, strategy, gradient_options)
    names = ["fit", "evaluate", "predict"]
    if strategy.size > 1 and strategy.runs_keras_loops:  # Keras's own loops read logs
        names += ["get_metrics_result", "_get_metrics_result_or_logs"]
    for name in names:
        override(model, name, getattr(training, name.lstrip("_")))
    override(model, "_keras_dist", training)
    script_saves.install(model, strategy)
    if gradient_options.shard is not None:
        optimizer_sharding.gathering_saves(model, strategy)
    return training
