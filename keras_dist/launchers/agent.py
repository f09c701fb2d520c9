"""A job as `keras-dist launch` runs it on one machine: its tasks started, watched, restarted.

The restart and preemption policy in one place, with explicit states (after torchrun's
elastic agent, without its rendezvous): a job runs its tasks (`processes.run_tasks`);
when they all succeed it has SUCCEEDED; when a notice stopped them (the launcher's
SIGTERM or SIGUSR1 passed on, or a task that got one itself and saved) it is PREEMPTED and
is not restarted, since the scheduler takes the machine; when a task failed it is
RESTARTING while restarts are left (each attempt resumes from the last backup), else
FAILED. An elastic job also restarts to grow: where `grows` says a machine waits to join,
the tasks get a notice, save and exit, and the job restarts with it (not counted among
the restarts after failures). `Job.run` returns a `RunResult` that names the task that
failed and why.
"""

import dataclasses
import enum
import sys
from collections.abc import Callable
from typing import TextIO

from keras_dist.launchers.base import Task
from keras_dist.launchers.processes import INTERRUPTED, run_tasks


class JobState(enum.Enum):
    RUNNING = "running"
    RESTARTING = "restarting"
    SUCCEEDED = "succeeded"
    PREEMPTED = "preempted"
    FAILED = "failed"


@dataclasses.dataclass(frozen=True)
class RunResult:
    """How a job ended.

    Attributes:
        state: SUCCEEDED, PREEMPTED or FAILED.
        exit_code: what `keras-dist launch` exits with: the first failing task's (128 + N
            for a task killed by signal N), 0, or the tasks' code after a notice (143).
        attempts: how many times the tasks were started.
        failed_task: the task that failed first in the last attempt (e.g. "rank:1"), if any.
    """

    state: JobState
    exit_code: int
    attempts: int
    failed_task: str | None = None

    def describe(self) -> str:
        """One line for the job's end."""
        tries = f"after {self.attempts} attempts" if self.attempts > 1 else "at its first attempt"
        if self.state is JobState.FAILED:
            return f"the job failed {tries}: task {self.failed_task} exited with {self.exit_code}"
        return f"the job {self.state.value} {tries} (exit {self.exit_code})"


class Job:
    """Runs `tasks_for(attempt)` until they succeed, a notice stops them, or `max_restarts` restarts are spent.

    Args:
        tasks_for: the tasks of attempt 0, 1, ... (each attempt's environment may differ:
            `KERAS_DIST_RESTART`, a machine's new place in a job of several).
        max_restarts: restarts after a failure (`keras-dist launch --max-restarts`).
        grace_seconds: how long tasks get to save and exit after a notice.
        out: where progress lines and the tasks' output go (default: standard output).
        grows: for an elastic job, why it restarts on more machines now (a machine waits to
            join), else None; asked while the tasks run and when they end after a notice.
    """

    def __init__(self, tasks_for: Callable[[int], list[Task]], max_restarts: int = 0, grace_seconds: float = 30.0,
                 out: TextIO | None = None, grows: Callable[[], str | None] | None = None):
        self._tasks_for, self._max_restarts, self._grace = tasks_for, max_restarts, grace_seconds
        self._out, self._grows = out or sys.stdout, grows
        self.state = JobState.RUNNING
        self.history: list[JobState] = []  # the states entered, in order

    def run(self) -> RunResult:
        attempts = failures = 0
        while True:
            self._enter(JobState.RUNNING)
            ended = run_tasks(self._tasks_for(attempts), out=self._out, grace_seconds=self._grace,
                              stop_when=self._grows)
            attempts += 1
            if ended.exit_code == 0:
                return self._end(JobState.SUCCEEDED, ended.exit_code, attempts)
            growing = self._grows() if self._grows is not None and ended.exit_code in INTERRUPTED else None
            if growing:
                self._enter(JobState.RESTARTING)
                self._say(f"the tasks saved and exited ({growing}); the job restarts with it")
                continue
            if ended.exit_code in INTERRUPTED:
                return self._end(JobState.PREEMPTED, ended.exit_code, attempts, ended.failed_task)
            failures += 1
            if failures > self._max_restarts:
                return self._end(JobState.FAILED, ended.exit_code, attempts, ended.failed_task)
            self._enter(JobState.RESTARTING)
            self._say(f"the job failed (task {ended.failed_task} exited with {ended.exit_code}); "
                      f"restart {failures} of {self._max_restarts}")

    def _say(self, line: str) -> None:
        self._out.write(f"[keras-dist] {line}\n")
        self._out.flush()

    def _enter(self, state: JobState) -> None:
        self.state = state
        self.history.append(state)

    def _end(self, state: JobState, exit_code: int, attempts: int, failed_task: str | None = None) -> RunResult:
        self._enter(state)
        return RunResult(state, exit_code, attempts, failed_task)
