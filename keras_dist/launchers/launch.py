"""`keras-dist launch` on this machine: the tasks of each attempt, machine 0's directory
and the job's secret (`--nnodes`), and the agent that runs, restarts and grows them. The
command line (`keras_dist.cli`) parses the arguments, chooses the strategy's tasks, and
reports the outcome."""

import contextlib
import dataclasses
import os
from collections.abc import Callable
from typing import NamedTuple

from keras_dist.launchers.agent import Job, JobState
from keras_dist.launchers.base import Task
from keras_dist.launchers.nodes import JobEnded, Nodes, directory, job_secret
from keras_dist.launchers.processes import BACKUP_DIR_VARIABLE, ELASTIC_VARIABLE, RESTART_VARIABLE
from keras_dist.settings import Settings


class Outcome(NamedTuple):
    """How the job ended on this machine: the exit code, and a line to report, if any."""

    exit_code: int
    report: str | None = None


def run_job(local_tasks: Callable[[Nodes | None], list[Task]], chosen: Settings, *, nodes: Nodes | None = None,
            exchanges: bool = False, max_restarts: int = 0, grace_period: float = 30.0,
            backup_dir: str | None = None) -> Outcome:
    """Runs this machine's tasks of a job until it ends.

    Args:
        local_tasks: this machine's tasks, given its place in the attempt (None: the only machine).
        chosen: keras_dist's settings (the job's secret).
        nodes: this machine's place among the job's machines (`--nnodes`), if several.
        exchanges: whether the machines learn each other's addresses at machine 0's directory
            (`keras_dist.launchers.EXCHANGING`), not the master's alone.
        max_restarts, grace_period, backup_dir: `keras-dist launch`'s options.

    Example:

    ```python
    outcome = run_job(lambda placed: strategies.local_cluster("horovod", 2, 0, ["train.py"], placed),
                      settings.current(), max_restarts=1)
    ```
    """
    # Where the machines meet at the master's directory, each signs its requests there with
    # the job's secret (torchrun's and JAX's jobs meet at their engine's own coordinator).
    meets = nodes and (nodes.elastic or exchanges)
    if meets:
        nodes = dataclasses.replace(nodes, secret=job_secret(chosen))

    placed = None  # this machine's place in the attempt under way

    def tasks_for(attempt: int) -> list[Task]:
        nonlocal placed
        if nodes:
            # An elastic job's machine may join late: its attempts are the master's. Where the
            # port is the engine's coordinator (torchrun's store, JAX's), each restart moves
            # it on: a machine that restarts first would otherwise meet the last attempt's,
            # still open while the master's tasks have not yet seen the failure.
            placed = (nodes.assemble(attempt, moves_port=not exchanges) if nodes.elastic
                      else dataclasses.replace(nodes, attempt=attempt,
                                               port=nodes.port if exchanges else nodes.port + attempt))
            attempt = placed.attempt
        tasks = local_tasks(placed if placed and placed.count > 1 else None)
        for task in tasks:
            task.env[RESTART_VARIABLE] = str(attempt)
            if nodes and nodes.elastic:
                task.env[ELASTIC_VARIABLE] = "1"
            if backup_dir:
                task.env[BACKUP_DIR_VARIABLE] = os.path.abspath(backup_dir)
        return tasks

    serves = meets and nodes.rank == 0
    grows = (lambda: nodes.grows(placed.attempt)) if nodes and nodes.elastic and nodes.count > 1 else None
    with directory(nodes) if serves else contextlib.nullcontext():
        try:
            result = Job(tasks_for, max_restarts, grace_period, grows=grows).run()
        except JobEnded as ended:
            return Outcome(0, str(ended))
    return Outcome(result.exit_code, result.describe() if result.state is JobState.FAILED and max_restarts else None)
