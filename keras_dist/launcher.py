"""Runs a script as a local cluster: one child process per task, torn down together.

Backends describe their tasks (`Backend.local_tasks`); this module only starts them,
prefixes every output line with its task's name, and stops everything when one task
fails or the user presses Ctrl-C. The exit code is the first failing task's.
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Task:
    """One process of a local cluster.

    Args:
        name: the prefix of its output lines, e.g. `worker:1`.
        argv: the command line.
        env: variables added to the launcher's environment.
        prefix_output: False when the command prefixes lines itself (`horovodrun`).
        serves: a server that runs until stopped (parameter-server workers and ps
            tasks): the job ends when every other task has, and a server that dies
            does not stop the job (the chief decides whether it can go on).
    """

    name: str
    argv: list
    env: dict = field(default_factory=dict)
    prefix_output: bool = True
    serves: bool = False


def free_loopback_ports(count):
    """Ports free on 127.0.0.1 now (held open together so they are distinct)."""
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _pump(stream, prefix, out):
    for line in iter(stream.readline, b""):
        out.write(prefix + line.decode(errors="replace"))
        out.flush()
    stream.close()


def run_tasks(tasks, out=None, poll_seconds=0.2):
    """Starts `tasks`, waits for all of them, returns the first failing exit code (or 0)."""
    out = out or sys.stdout
    procs, pumps = [], []
    try:
        for task in tasks:
            proc = subprocess.Popen(
                task.argv,
                env={**os.environ, **task.env},
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: we can kill its children
            )
            procs.append((task, proc))
            prefix = f"[{task.name}] " if task.prefix_output else ""
            pump = threading.Thread(target=_pump, args=(proc.stdout, prefix, out), daemon=True)
            pump.start()
            pumps.append(pump)
        reported = set()
        while True:
            codes = [proc.poll() for _, proc in procs]
            for (task, _), code in zip(procs, codes):
                if task.serves and code is not None and task.name not in reported:
                    reported.add(task.name)
                    out.write(f"[keras-dist] server {task.name} exited with {code}; the job goes on without it\n")
            failed = [(task, code) for (task, _), code in zip(procs, codes) if code not in (None, 0) and not task.serves]
            if failed:
                task, code = failed[0]
                out.write(f"[keras-dist] task {task.name} exited with {code}; stopping the others\n")
                return code
            if all(code == 0 for (task, _), code in zip(procs, codes) if not task.serves):
                return 0
            time.sleep(poll_seconds)
    except KeyboardInterrupt:
        out.write("[keras-dist] interrupted; stopping every task\n")
        return 130
    finally:
        _stop(procs)
        for pump in pumps:
            pump.join(timeout=5)


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


def kill_process_groups(procs):
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
