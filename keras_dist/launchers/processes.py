"""Runs a local cluster's tasks: one child process per task, torn down together.

Launchers describe the tasks (`keras_dist.launchers.Launcher`); this module starts them,
prefixes every output line with its task's name, and stops everything when one task
fails, or the launcher gets Ctrl-C. The exit code is the first failing task's, 128 + the
signal for a task killed by one (as a shell reports it). A SIGTERM or SIGUSR1 to the
launcher (a preemption notice) is passed on to every task, which saves and exits
(`keras_dist.fault_tolerance.preemption`); tasks still running after the grace period, or at a
second signal, are killed.

Tasks never outlive the launcher, even a SIGKILLed one: each direct child gets a
parent-death signal, and every process of the job (torchrun's and horovodrun's workers
too) finds the launcher's pid in `KERAS_DIST_LAUNCHER_PID` and ends itself once it, or
the process that started it, is gone (`watch_launcher`, started by `import keras_dist`).
"""

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, TextIO

from keras_dist import console, settings

if TYPE_CHECKING:
    from keras_dist.launchers.base import Task

LAUNCHER_PID_VARIABLE = "KERAS_DIST_LAUNCHER_PID"
# How many times `keras-dist launch --max-restarts` has restarted the job, in every task.
RESTART_VARIABLE = "KERAS_DIST_RESTART"
# Set in every task of an elastic job (`--nnodes MIN:MAX`).
ELASTIC_VARIABLE = "KERAS_DIST_ELASTIC"
# Where `keras-dist launch --backup-dir` backs up every fit of an unchanged script
# (`keras_dist.fault_tolerance.resume.automatic_backup`).
BACKUP_DIR_VARIABLE = "KERAS_DIST_BACKUP_DIR"
# The job's secret (`keras_dist.launchers.nodes.job_secret`), kept from the tasks.
SECRET_VARIABLE = "KERAS_DIST_JOB_SECRET"
# The signals of a preemption notice (SLURM's `--signal` often uses SIGUSR1): the launcher
# passes them on, and `keras_dist.fault_tolerance.preemption` saves and stops at them.
NOTICE_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name))
# Seconds between the questions of `run_tasks(stop_when=...)` (an elastic job asks its master
# over the network whether a machine waits to join).
STOP_WHEN_SECONDS = 1.0


def free_ports(count: int, address: str = "127.0.0.1") -> list:
    """Ports free on `address` now (held open together so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind((address, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _pump(stream, prefix, out, drop_start_up_lines):
    for line in iter(stream.readline, b""):
        text = line.decode(errors="replace")
        if drop_start_up_lines and console.is_start_up_line(text):
            continue
        out.write(prefix + text)
        out.flush()
    stream.close()


# What tells a process which cluster it is in: the tasks get their own, never the shell's.
_CLUSTER_VARIABLES = ("TF_CONFIG", "HOROVOD_", "OMPI_COMM_WORLD_", "PMI_", "MPI_LOCALNRANKS", LAUNCHER_PID_VARIABLE)


@dataclasses.dataclass(frozen=True)
class Ended:
    """How one start of a job's tasks ended: the exit code to report, and the task that failed first."""

    exit_code: int
    failed_task: str | None = None


def _tasks_environment(out: TextIO) -> tuple[dict[str, str], bool]:
    """The environment every task starts from, and whether their start-up lines are quieted."""
    inherited = sorted(k for k in os.environ if k.startswith(_CLUSTER_VARIABLES))
    if inherited:
        out.write(f"[keras-dist] ignoring {', '.join(inherited)} from the shell: each task gets its own\n")
    # The job's secret is its launchers' alone: no task needs it, and one that logs its
    # environment would show it.
    base = {k: v for k, v in os.environ.items() if k not in inherited and k != SECRET_VARIABLE}
    chosen = settings.Settings.from_environ(base)
    base.update(console.quiet_tensorflow_variables(base, chosen))
    return base, not chosen.debug_log


def _how_tasks_ended(procs: list, reported: set, out: TextIO) -> Ended | None:
    """How the job ended, once it has: the first task that failed (servers aside, which the
    chief judges: said once each), or every trainer done; None while it runs."""
    codes = [proc.poll() for _, proc in procs]
    for (task, _), code in zip(procs, codes):
        if task.serves and code not in (None, 0) and task.name not in reported:
            reported.add(task.name)
            out.write(f"[keras-dist] server {task.name} exited with {exit_code(code)}; "
                      "the chief decides whether the job can go on\n")
    failed = [(task, code) for (task, _), code in zip(procs, codes) if code not in (None, 0) and not task.serves]
    if failed:
        task, code = failed[0]
        out.write(f"[keras-dist] task {task.name} exited with {exit_code(code)}; stopping the others\n")
        return Ended(exit_code(code), task.name)
    trainers = [code for (task, _), code in zip(procs, codes) if not task.serves]
    if trainers and all(code == 0 for code in trainers):
        return Ended(0)
    if not trainers and all(code is not None for code in codes):
        # A machine of servers only (`--nnodes`): they end with the chief, elsewhere.
        return next((Ended(exit_code(code), task.name) for (task, _), code in zip(procs, codes) if code), Ended(0))
    return None


def child_environment(**variables: str) -> dict[str, str]:
    """This process's environment with `variables` in it: what a child process the
    `keras-dist` tool starts inherits."""
    return {**os.environ, **variables}


def run_tasks(tasks: Iterable["Task"], out: TextIO | None = None, poll_seconds: float = 0.2,
              grace_seconds: float = 30.0, stop_when: Callable[[], str | None] | None = None) -> Ended:
    """Starts `tasks`, waits for all of them, returns the first failing exit code (or 0) and its task.

    `grace_seconds`: how long tasks get to exit after a notice passed on to them.
    `stop_when`: asked about once a second; where it gives a reason, the tasks get a
    notice (SIGTERM: they save and exit), as at the launcher's own SIGTERM.
    """
    out = out or sys.stdout
    base, quiet = _tasks_environment(out)
    procs, pumps = [], []
    terminate_with_parent = _parent_death_signal()
    handled = NOTICE_SIGNALS if threading.current_thread() is threading.main_thread() else ()
    previous_handlers = {sig: signal.signal(sig, _interrupt) for sig in handled}
    try:
        for task in tasks:
            proc = subprocess.Popen(
                task.argv,
                env={**base, **task.env, LAUNCHER_PID_VARIABLE: str(os.getpid())},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: we can kill its children
                preexec_fn=terminate_with_parent,
            )
            procs.append((task, proc))
            prefix = f"[{task.name}] " if task.prefix_output else ""
            pump = threading.Thread(target=_pump, args=(proc.stdout, prefix, out, quiet), daemon=True)
            pump.start()
            pumps.append(pump)
        reported, asked = set(), time.monotonic()
        while True:
            if stop_when is not None and time.monotonic() - asked >= STOP_WHEN_SECONDS:
                asked = time.monotonic()
                reason = stop_when()
                if reason:
                    return Ended(_pass_on_notice(signal.SIGTERM, procs, grace_seconds, out, reason))
            ended = _how_tasks_ended(procs, reported, out)
            if ended is not None:
                return ended
            time.sleep(poll_seconds)
    except KeyboardInterrupt as interrupt:
        sig = interrupt.args[0] if interrupt.args else signal.SIGINT
        if sig in NOTICE_SIGNALS:
            return Ended(_pass_on_notice(sig, procs, grace_seconds, out))
        out.write(f"[keras-dist] {signal.Signals(sig).name}; stopping every task\n")
        return Ended(128 + sig)
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        _stop(procs)
        for pump in pumps:
            pump.join(timeout=5)




def _pass_on_notice(sig, procs, grace_seconds, out, reason=None):
    """Passes `sig` on to every task and waits up to `grace_seconds` for them to save and
    exit; returns the tasks' exit code where they all exited alike, else 128 + `sig`."""
    name = signal.Signals(sig).name
    because = f" ({reason})" if reason else ""
    out.write(f"[keras-dist] {name}{because}: passed on to every task, which saves and exits "
              f"(killed in {grace_seconds:g} s, or at a second signal)\n")
    for _, proc in procs:
        if proc.poll() is None:
            # The task's own process only: its helpers (DataLoader workers) end with it.
            proc.send_signal(sig)
    deadline = time.monotonic() + grace_seconds
    try:
        while time.monotonic() < deadline and any(proc.poll() is None for _, proc in procs):
            time.sleep(0.1)
    except KeyboardInterrupt:
        out.write("[keras-dist] second signal: stopping every task now\n")
    codes = {exit_code(proc.returncode) for _, proc in procs if proc.returncode is not None}
    if len(codes) == 1 and all(proc.returncode is not None for _, proc in procs):
        return codes.pop()
    return 128 + sig


# Exit codes of tasks stopped by Ctrl-C or SIGTERM (`run_tasks`): not restarted, not a failure.
INTERRUPTED = (130, 143)


def exit_code(returncode: int) -> int:
    """A `Popen.returncode` as a shell reports it: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signum)  # SIGTERM stops the job as Ctrl-C does


_PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A function for the child, before exec, that asks Linux to SIGTERM it when the
    launcher dies; None elsewhere. Looked up here, in the parent: after a fork, the child
    of a threaded process (the launcher pumps output on threads) must not import."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def watch_launcher(environ: Mapping[str, str], poll_seconds: float = 1.0) -> None:
    """Ends this process once the launcher that started its job, or the task that started
    this process, is gone.

    Called at `import keras_dist` in every task: a task started by a task (torchrun's and
    horovodrun's workers) gets no parent-death signal from the launcher, so it checks the
    launcher's pid itself, on a daemon thread, and exits with 128 + SIGHUP like a hung-up
    session. It checks its own parent too: torchrun starts each worker in a session of its
    own, so a SIGKILLed torchrun leaves its worker running, outside the process group the
    launcher stops, and the worker of a failed attempt would train on beside the next.
    """
    launcher = int(environ.get(LAUNCHER_PID_VARIABLE, 0) or 0)
    if not launcher:
        return
    starter = os.getppid()

    def watch():
        while True:
            time.sleep(poll_seconds)
            gone = ("the launcher" if process_ended(launcher) else
                    "the task that started it" if os.getppid() != starter else None)
            if gone:
                try:
                    sys.stderr.write(f"keras_dist: {gone} is gone; this task stops\n")
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass  # stderr was the launcher's pipe
                os._exit(128 + signal.SIGHUP)

    threading.Thread(target=watch, name="keras_dist-launcher-watch", daemon=True).start()


def process_ended(pid: int) -> bool:
    """Whether process `pid` has ended: gone, or a zombie its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive (someone else's)
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False  # no /proc (not Linux): alive as far as we can tell


def _stop(procs, grace_seconds=5):
    for _, proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_seconds
    for _, proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    # The group may outlive its leader (horovodrun's workers): always sweep it.
    kill_process_groups([proc for _, proc in procs])


def kill_process_groups(procs: Iterable[subprocess.Popen]) -> None:
    """SIGKILLs the process group of each `subprocess.Popen` (started with
    `start_new_session=True`) and reaps its leader; children that outlived it die too.

    Example:

    ```python
    procs = [subprocess.Popen(argv, start_new_session=True) for argv in commands]
    try:
        ...
    finally:
        kill_process_groups(procs)
    ```
    """
    for proc in procs:
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc, sig):
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
