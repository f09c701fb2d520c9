"""A save at the preemption notice: SIGTERM or SIGUSR1 ends `fit` at a step every process agrees on.

Spot and preemptible VMs, Kubernetes evictions and SLURM (`--signal`) send SIGTERM (or a
chosen signal, often SIGUSR1) and kill a grace period later (30 s by default on
Kubernetes). The signal may reach one task (the kubelet signals each pod; SLURM each
step) or the launcher, which passes it on to every task. A task that gets it only notes
it: the tasks then agree, at the next check, on the step to stop after, so no collective
is left half-done. There the chief writes a backup (where `fit` has one:
`keras_dist.fault_tolerance.resume`) and every task exits with `PREEMPTED_EXIT_CODE`. A second
signal ends the task at once, as without keras_dist.

In a SLURM batch job, SIGUSR1 is the notice a script asks for ahead of its time limit
(`#SBATCH --signal=B:USR1@90`): after the save the chief requeues the job (`scontrol
requeue`), so that it goes on from the backup when it runs again. SIGTERM does not
requeue: it is also how `scancel` ends a job, and SLURM requeues the jobs it preempts itself.

The check is one small collective, run every step at first and then about once a second
(the chief measures the step time and sets the next check's step for all, the interval
at most doubling from one check to the next), so that a notice costs about a second of
training before the save begins, and fast steps pay for one collective a second only.
"""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import keras
import numpy as np

from keras_dist.fault_tolerance import background_writes
from keras_dist.launchers.processes import NOTICE_SIGNALS
from keras_dist.settings import Settings

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

logger = logging.getLogger("keras_dist")

# The exit code of a task stopped at a notice: 128 + SIGTERM, as a shell and Kubernetes
# report a process SIGTERM ended (a restartable stop), whichever signal came.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
# Seconds of training between two checks, once the step time is known.
_CHECK_SECONDS = 1.0
# `0` turns off the requeue of a SLURM job stopped at SIGUSR1.
SLURM_REQUEUE_VARIABLE = "KERAS_DIST_SLURM_REQUEUE"
# The signal handlers a notice replaced while its `fit` runs (on the main thread): what a
# process forked meanwhile must have again.
_REPLACED: dict = {}


def _signals_as_before_in_child() -> None:
    """In a process forked during `fit` (a `PyDataset(use_multiprocessing=True)` pool worker):
    the signals act as without keras_dist. The pool ends its workers with SIGTERM; with the
    notice's handler inherited they printed "SIGTERM received" and lived on, and one blocked
    on its queue's lock hung the parent's exit, where multiprocessing waits for it (issue 44)."""
    for sig, handler in _REPLACED.items():
        signal.signal(sig, handler)
    _REPLACED.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_signals_as_before_in_child)


class PreemptionNotice(keras.callbacks.Callback):
    """Notes SIGTERM and SIGUSR1 during `fit`; the processes agree on the step to stop after.

    keras_dist adds it first among `fit`'s callbacks, on every process. Its handlers are
    set for the duration of `fit` only, on the main thread, and not in processes forked
    meanwhile; elsewhere a signal acts as it would without keras_dist.

    Args:
        replicas: the job as this process sees it (`Replicas`).
        backup_seconds: where set (the backups of `--backup-dir`), the chief also asks
            for a backup once this many seconds have passed since the last one.
    """

    def __init__(self, replicas: "Replicas", backup_seconds: float | None = None) -> None:
        super().__init__()
        self.replicas, self.backup_seconds = replicas, backup_seconds
        # Where the backup at the agreed step goes (`ResumePoint`); None: nothing is saved.
        self.saved_in: str | None = None
        # The agreed step was an epoch's last: the save, and the exit, come at its end.
        self.exit_deferred = False
        self.backup_due = False  # agreed: back up after this step (the chief's clock)
        self._previous: dict = {}
        self._handling_pid = os.getpid()  # the process whose handlers these are

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.received: int | None = None  # the signal noted here
        self.stopping = False  # agreed: stop after this step
        self.requeue = False  # agreed: some process got SIGUSR1 (`requeue_slurm_job`)
        self._steps, self._next_check, self._interval = 0, 1, 1
        self._last_check, self._last_backup = (0, time.monotonic()), time.monotonic()
        if threading.current_thread() is threading.main_thread():
            # Noted before the handlers are set: Keras forks a PyDataset's pool from a thread of
            # its own, and a child forked in between must find what to put back (issue 44).
            self._previous = {sig: signal.getsignal(sig) for sig in NOTICE_SIGNALS}
            self._handling_pid = os.getpid()
            _REPLACED.update(self._previous)
            for sig in NOTICE_SIGNALS:
                signal.signal(sig, self._note)

    def on_train_end(self, logs: dict | None = None) -> None:
        self._restore_handlers()

    def _restore_handlers(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
        _REPLACED.clear()

    def _note(self, signum: int, frame: object) -> None:
        if os.getpid() != self._handling_pid:
            # A process forked during fit that kept the handler, where `_signals_as_before_in_child`
            # missed it (seen on a loaded machine; cause not found): as without keras_dist.
            signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
            signal.raise_signal(signum)
            return
        if self.received is not None:  # a second signal: at once, as without keras_dist
            self._restore_handlers()
            signal.raise_signal(signum)
            return
        self.received = signum
        sys.stderr.write(f"keras_dist: {signal.Signals(signum).name} received; training stops after an agreed "
                         "step and saves\n")

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        self.backup_due = False
        self._steps += 1
        if self._steps < self._next_check:
            return
        steps, started = self._last_check
        now = time.monotonic()
        interval = 0
        if self.replicas.is_chief:
            per_step = (now - started) / max(1, self._steps - steps)
            # Doubling at most from one check to the next: first steps can be faster than
            # the ones that follow (an eager step before the input pipeline fills).
            interval = int(np.clip(_CHECK_SECONDS / max(per_step, 1e-6), 1, 2 * self._interval))
            time_due = self.backup_seconds is not None and now - self._last_backup >= self.backup_seconds
        else:
            time_due = False
        usr1 = self.received is not None and self.received == getattr(signal, "SIGUSR1", None)
        noticed, due, interval, requeue = self.replicas.collectives.sum_arrays(
            [np.array([self.received is not None, time_due, interval, usr1], dtype=np.float64)])[0]
        self._last_check, self._interval = (self._steps, now), int(interval)
        self._next_check = self._steps + self._interval
        self.stopping, self.backup_due, self.requeue = bool(noticed), bool(due), bool(requeue)

    def backed_up(self) -> None:
        """Restarts the clock of time-based backups."""
        self._last_backup = time.monotonic()

    @property
    def last(self) -> keras.callbacks.Callback:
        """Its part after every other callback: ends the process once the agreed step (or
        its epoch, where the save waits for the epoch's end) is done and saved."""
        return _ExitAtAgreedStep(self)

    def exit(self) -> None:
        """Ends this process after the agreed step, with `PREEMPTED_EXIT_CODE`, once its backup is on disk."""
        self._restore_handlers()
        background_writes.wait_for_all()
        if self.replicas.is_chief:
            if self.saved_in:
                logger.warning("keras_dist: stopped at the preemption notice; the state is saved in %s and the next "
                               "run resumes there (exit %s)", self.saved_in, PREEMPTED_EXIT_CODE)
            else:
                logger.warning("keras_dist: stopped at the preemption notice, with nothing saved: run with "
                               "keras-dist launch --backup-dir DIR (or KERAS_DIST_BACKUP_DIR) to resume from here "
                               "(exit %s)", PREEMPTED_EXIT_CODE)
            if self.saved_in and self.requeue:
                requeue_slurm_job(self.replicas.settings)
        sys.stdout.flush()
        sys.stderr.flush()
        raise SystemExit(PREEMPTED_EXIT_CODE)


def requeue_slurm_job(chosen: Settings) -> None:
    """Puts the SLURM batch job this process runs in (`SLURM_JOB_ID` in `chosen.variables`) back
    in the queue (`scontrol requeue`), where there is one and `KERAS_DIST_SLURM_REQUEUE` is not
    `0` in `chosen`; says in one line what came of it."""
    job = chosen.variables.get("SLURM_JOB_ID")
    if not job or not chosen.slurm_requeue:
        return
    # Said before: a requeue cancels the running job at once, and SLURM's signals can end this
    # process before `scontrol` returns (seen in CI: the job requeued, the line after it lost).
    logger.warning("keras_dist: requeueing SLURM job %s: it resumes from the backup when it runs again", job)
    sys.stderr.flush()
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.warning("keras_dist: could not requeue SLURM job %s (%s); requeue it with scontrol requeue %s",
                       job, exc, job)
        return
    if done.returncode == 0:
        return
    said = (done.stderr or done.stdout).strip().splitlines()
    logger.warning("keras_dist: scontrol requeue %s failed (%s); submit the job with --requeue, or set %s=0 not to "
                   "requeue", job, said[-1] if said else f"exit {done.returncode}", SLURM_REQUEUE_VARIABLE)


class _ExitAtAgreedStep(keras.callbacks.Callback):
    def __init__(self, notice: PreemptionNotice) -> None:
        super().__init__()
        self.notice = notice

    def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
        if self.notice.stopping and not self.notice.exit_deferred:
            self.notice.exit()

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if self.notice.stopping:
            self.notice.exit()

