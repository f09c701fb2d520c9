"""JAX's process group, watched: a process that stops beating, and a step or host collective that never ends.

JAX bounds neither. Its heartbeats end a job whose process froze, but by aborting with a
C++ stack trace, and its gloo collectives wait for ever. And a process can keep beating
while its step never finishes: on XLA's CPU client, an allocation that fails inside a
running computation (under a memory cap, at the edge) leaves the step's outputs never
ready, and the other processes wait for it in their next collective, for ever
(bench/results/2026-11-27-cpu-2core-sharding-jax.md). So each process times its own
waits, and tells the others, in JAX's key-value store, what it waits in.
"""

import atexit
import collections
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from keras_dist import errors, timeouts
from keras_dist.errors import KerasDistError, PeerFailure

logger = logging.getLogger("keras_dist")

# What a process waits in, as its beats say: a step it dispatched, a host collective, or
# neither (its own work: input, a callback, a save, compiling the step).
STEP, COLLECTIVE, OWN_WORK = "step", "collective", "own"

_FIX = ("a process short of memory can leave its step unfinished instead of failing (XLA's CPU client): "
        "keras_dist.compile(model, ..., shard='weights') keeps 1/N of the weights and the optimizer's state on each "
        "of N processes (docs/sharding.md), or train with a smaller batch; "
        f"or raise {timeouts.STEP_TIMEOUT_VARIABLE} if steps are that slow")


def coordination_client() -> Any:
    """The client of JAX's coordination service (its key-value store), once the process group started."""
    from jax._src import distributed

    return distributed.global_state.client


def give_up(message: str) -> None:
    logger.error(message)
    os._exit(1)


class PeerWatch:
    """Ends this process in one line naming the process that stopped answering, or whose
    step (or host collective) did not finish.

    Beats: JAX's heartbeat callback cannot be set (jaxlib 0.10:
    `get_distributed_runtime_client(missed_heartbeat_callback=...)` fails with
    std::bad_cast). So each process also beats in the coordination service's key-value
    store, with JAX's heartbeat timeout at twice this watch's plus `MARGIN_SECONDS`
    seconds. Beats run on threads of their own (the store's calls release the GIL): a
    busy process keeps beating; only a frozen or cut-off one stops. A process that ends
    marks itself done.

    Waits: each beat also says what the process waits in (`STEP`, `COLLECTIVE` or
    `OWN_WORK`) and for how long. A step's clock runs from when it is dispatched, or the
    one before it finished, to when its outputs are ready (seen each second off the main
    thread, which keeps dispatching ahead). A process whose wait is late
    (`_late`) ends in one line saying what every process waits in.
    """

    MARGIN_SECONDS = 10
    DONE = "done"

    def __init__(self, client, rank: int, size: int, step_timeout: timeouts.StepTimeout):
        self._client, self._rank = client, rank
        self._timeout, self._first = step_timeout.later, step_timeout.first
        client.key_value_set(f"keras_dist/host/{rank}", socket.gethostname())
        self._hosts = [client.blocking_key_value_get(f"keras_dist/host/{r}", int(self._timeout * 1000)) for r in range(size)]
        now = time.monotonic()
        self._answered = now  # when the coordinator last answered
        self._seen = {r: (None, now) for r in range(size) if r != rank}  # last beat, when it changed
        self._done = threading.Event()
        # Dispatched calls not yet seen finished, oldest first: number, an output, when dispatched, steps in it.
        self._dispatched: "collections.deque[tuple[int, Any, float, int]]" = collections.deque()
        self._calls = 0
        self._step: tuple[int, float, int] | None = None  # the oldest unfinished call: number, since, steps
        self._steps_done = 0
        self._collective_since: float | None = None
        self._step_finished = now  # when this process last saw a step finish

    def start(self) -> None:
        atexit.register(self._finish)  # after JAX's own exit handler, so it runs first
        for target in (self._beat, self._check):
            threading.Thread(target=target, name=f"keras_dist {target.__name__[1:]}", daemon=True).start()

    # --- what this process waits in ------------------------------------------------
    def timed_steps(self, train_function: Callable, steps_per_call: int) -> Callable:
        """`train_function` (Keras's, `(state, data) -> (logs, state)`), its steps timed."""
        if getattr(train_function, "_keras_dist_timed", False):
            return train_function
        import jax

        def timed(state, data):
            logs, state = train_function(state, data)
            # All of a step's outputs are ready together: one stands for the step.
            output = next((leaf for leaf in jax.tree.leaves(logs) if hasattr(leaf, "is_ready")), None)
            self._calls += 1
            self._dispatched.append((self._calls, output, time.monotonic(), steps_per_call))
            return logs, state

        timed._keras_dist_timed = True
        return timed

    @contextlib.contextmanager
    def in_collective(self) -> Iterator[None]:
        """Times a host collective (`JaxProcesses`) as a wait of this process."""
        self._collective_since = time.monotonic()
        try:
            yield
        finally:
            self._collective_since = None

    def _see_finished_steps(self, now: float) -> None:
        """Drops the dispatched steps whose outputs are ready, and starts the clock of the
        oldest unfinished one (`_check`'s thread alone, each second: nothing on the step's path
        but an append)."""
        while self._dispatched:
            output = self._dispatched[0][1]
            with contextlib.suppress(Exception):  # a failed or deleted output: the main thread raises its error
                if output is not None and not output.is_ready():
                    break
            self._dispatched.popleft()
            self._steps_done += 1
            self._step_finished = now
        if not self._dispatched:
            self._step = None
            return
        number, _, dispatched, steps = self._dispatched[0]
        if self._step is None or self._step[0] != number:
            self._step = (number, max(dispatched, self._step_finished), steps)

    def _waiting(self, now: float) -> tuple[str, float, int]:
        """What this process waits in, for how long, and how many steps that wait may take
        (a call of `steps_per_execution` steps: that many step timeouts)."""
        step = self._step
        if step is not None:
            return STEP, now - step[1], step[2]
        since = self._collective_since
        if since is not None:
            return COLLECTIVE, now - since, 1
        return OWN_WORK, 0.0, 1

    # --- beats -------------------------------------------------------------------
    def all_arrive(self, label: str) -> None:
        """Returns once every process has called it with `label` (the same sequence of labels
        everywhere); raises `PeerFailure` naming the processes that ended or did not come
        within the watch's timeout. A JAX collective would wait forever for a process that
        ended cleanly (a save on the chief alone)."""
        self._client.key_value_set(f"keras_dist/arrived/{label}/{self._rank}", "1")
        waiting = set(range(len(self._hosts))) - {self._rank}
        deadline = time.monotonic() + self._timeout
        while waiting:
            for rank in list(waiting):
                with contextlib.suppress(Exception):  # not there yet
                    if self._client.key_value_try_get(f"keras_dist/arrived/{label}/{rank}"):
                        waiting.discard(rank)
            ended = [r for r in waiting if self._has_ended(r)]
            if ended or (waiting and time.monotonic() > deadline):
                late = ended or sorted(waiting)
                raise PeerFailure([f"rank {r} on {self._hosts[r]}" for r in late], None if ended else f"{self._timeout:g} s",
                                  "call it on every process", exited=bool(ended))
            if waiting:
                time.sleep(0.05)

    def _has_ended(self, rank: int) -> bool:
        with contextlib.suppress(Exception):
            return self._client.key_value_try_get(f"keras_dist/beat/{rank}") == self.DONE
        return False

    def _finish(self) -> None:
        self._done.set()
        with contextlib.suppress(Exception):
            self._client.key_value_set(f"keras_dist/beat/{self._rank}", self.DONE, allow_overwrite=True)

    def _beat(self) -> None:
        interval, count = self._timeout / 6, 0
        while not self._done.wait(interval):
            count += 1
            kind, waited, steps = self._waiting(time.monotonic())
            try:
                self._client.key_value_set(f"keras_dist/beat/{self._rank}",
                                           f"{count} {kind} {waited:.1f} {steps} {' '.join(map(str, _memory()))}",
                                           allow_overwrite=True)
            except Exception:  # the coordinator stopped answering: `_check` says so, in one line
                continue
            for rank, (last, _) in list(self._seen.items()):
                with contextlib.suppress(Exception):  # not beaten yet
                    beat = self._client.key_value_try_get(f"keras_dist/beat/{rank}")
                    if beat == self.DONE:
                        del self._seen[rank]
                    elif beat != last:
                        self._seen[rank] = (beat, time.monotonic())
            self._answered = time.monotonic()

    def _check(self) -> None:
        while not self._done.wait(1):
            try:
                self._check_once()
            except Exception:  # keep watching for silent peers whatever went wrong here
                logger.debug("keras_dist: the peer watch's check failed", exc_info=True)

    def _check_once(self) -> None:
        now = time.monotonic()
        self._see_finished_steps(now)
        silent = [r for r, (_, changed) in list(self._seen.items()) if now - changed > self._timeout]
        if now - self._answered > self._timeout:
            silent = [0]
        if silent and not self._done.is_set():
            stopped = [f"rank {r} on {self._hosts[r]}" + (" (JAX's coordinator)" if r == 0 else "") for r in silent]
            failure = PeerFailure(stopped, f"{self._timeout:g} s",
                                  f"or raise {timeouts.STEP_TIMEOUT_VARIABLE} if it can be that busy")
            give_up(f"PeerFailure: {failure}")
        if self._late(now):
            line = self._stall_line()
            self._finish()  # its peers then see it ended, not frozen
            errors.end_process(KerasDistError(line))

    # --- a stalled job -------------------------------------------------------------
    def _waits(self) -> dict[int, tuple[str, float, int, int, int]]:
        """Each rank's wait as its last beat said (this one's as now): kind, seconds, steps
        it may take, memory cap and peak resident memory in MiB (`_memory`)."""
        waits = {}
        for rank, (beat, _) in list(self._seen.items()):
            fields = (beat or "").split()
            waits[rank] = ((fields[1], float(fields[2]), *map(int, fields[3:6])) if len(fields) == 6
                           else (OWN_WORK, 0.0, 1, 0, 0))
        waits[self._rank] = (*self._waiting(time.monotonic()), *_memory())
        return waits

    def _late(self, now: float) -> bool:
        """Whether this process's wait ends the job: decided only while every peer beats (a
        silent one is named as such) and none is busy on its own (a save, its input, a
        compile, evaluating its shard: JAX bounds none of those, and neither does this).
        Then either every process waited `first` seconds (per step of its call), or the job
        is stalled (`_stalled`) and this process waited `later` seconds."""
        kind, waited, steps = self._waiting(now)
        if kind == OWN_WORK or any(now - changed > self._timeout / 2 for _, changed in list(self._seen.values())):
            return False
        waits = self._waits()
        if any(kind == OWN_WORK for kind, *_ in waits.values()):
            return False
        if all(seconds > self._first * steps for _, seconds, steps, _, _ in waits.values()):
            return True
        return waited > self._timeout * steps and self._stalled(waits)

    def _stalled(self, waits: dict[int, tuple[str, float, int, int, int]]) -> bool:
        """Every process has waited a while, and some for a step: past this process's first
        steps (they may start collectives lazily), or while some process went on past it,
        into a host collective. (All in host collectives may be a long transfer: `first`
        bounds those.)"""
        if any(seconds < self._timeout / 2 * steps for _, seconds, steps, _, _ in waits.values()):
            return False
        kinds = {kind for kind, *_ in waits.values()}
        return STEP in kinds and (self._steps_done >= timeouts.FIRST_STEPS or COLLECTIVE in kinds)

    def _stall_line(self) -> str:
        """What every process waits in, and which ran close to its memory cap."""
        said = {STEP: "waits {:.0f} s for its step to finish", COLLECTIVE: "waits {:.0f} s in a host collective",
                OWN_WORK: "is busy outside a step"}
        states, short = [], []
        for rank, (kind, waited, _, cap, peak) in sorted(self._waits().items()):
            memory = f" (peak RSS {peak} MiB of a {cap} MiB cap)" if cap else ""
            states.append(f"rank {rank} on {self._hosts[rank]}{memory} {said[kind].format(waited)}")
            if cap and peak >= 0.8 * cap:
                short.append(f"rank {rank}")
        likely = f"; likely short of memory: {', '.join(short)}" if short else ""
        return f"the job stalled: {'; '.join(states)}{likely}; {_FIX}"


def _memory() -> tuple[int, int]:
    """This process's memory cap (`RLIMIT_DATA` or `RLIMIT_AS`, the limits under which an
    allocation fails; 0: none) and its peak resident memory, in MiB (0, 0 without POSIX's `resource`)."""
    try:
        import resource
    except ImportError:
        return 0, 0
    caps = [resource.getrlimit(limit)[0] for limit in (resource.RLIMIT_DATA, resource.RLIMIT_AS)]
    cap = min((c for c in caps if c != resource.RLIM_INFINITY), default=0)
    return cap >> 20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10
