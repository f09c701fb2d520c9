"""The exception types keras_dist raises: bad input or a bad environment, and a peer that stopped."""

import contextlib
import os
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn


class KerasDistError(RuntimeError):
    """A one-line message that says what is wrong and names the fix."""


def first_line(error: BaseException) -> str:
    """An engine's error in one line: its first, at most 200 characters (its type where it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def is_out_of_memory(error: BaseException) -> bool:
    """Whether `error` is a failed allocation: Python's `MemoryError`, PyTorch's (its CPU
    allocator's `RuntimeError`, CUDA's `OutOfMemoryError`), XLA's `RESOURCE_EXHAUSTED`, or
    TensorFlow's `ResourceExhaustedError`."""
    if isinstance(error, MemoryError) or type(error).__name__ in ("OutOfMemoryError", "ResourceExhaustedError"):
        return True
    text = str(error)
    return "can't allocate memory" in text or ("RESOURCE_EXHAUSTED" in text and "memory" in text.lower())


class PeerFailure(KerasDistError):
    """Another process of the job stopped answering: its machine froze, lost its network or ended.

    One format on every backend, whichever engine noticed (a collective's timeout, a
    heartbeat, a store, a parameter-server step): who stopped (rank or task, and host), how
    long this process waited, what the engine said, and the fix.

    Args:
        stopped: each process that stopped, as "rank R on HOST" or a TensorFlow task and
            its address; empty where the engine cannot tell which.
        within: how long this process waited, e.g. "10 s" or "TensorFlow's heartbeat timeout";
            None where the engine saw the connection close.
        fix: what to do about it.
        cause: what the engine said, where it adds something (its first line is kept).
        exited: the process is known to have ended (its connection closed, its port refuses):
            its own output says why, and no timeout is to blame.
    """

    def __init__(self, stopped: Sequence[str], within: str | None, fix: str, cause: str | None = None,
                 exited: bool = False):
        self.stopped = list(stopped)
        who = ", ".join(self.stopped) or "a peer"
        said = f" ({cause.strip().splitlines()[0]})" if cause and cause.strip() else ""
        if exited:
            super().__init__(f"{who} exited{said}; its own output says why; {fix}")
            return
        waited = f" within {within}" if within else ""
        super().__init__(f"{who} stopped answering{waited}{said}: its machine froze, lost its network or ended; {fix}")


_FAILURE_NOTES: list[Callable[[], None]] = []


def note_failures_with(note: Callable[[], None]) -> None:
    """Runs `note` when this process ends with an uncaught exception, before it prints.

    For peers to tell a process that exited from one that froze: Horovod's strategy writes
    "exited" into horovodrun's store, which its peers read when their collective fails.
    Takes effect where `uncaught_errors_in_one_line` is installed (jobs of several processes).
    """
    _FAILURE_NOTES.append(note)


def uncaught_errors_in_one_line(one_line: bool = True) -> None:
    """Makes an uncaught `KerasDistError` print its one line, without the traceback above it.

    For the processes of a job, whose outputs a launcher interleaves: the line says what
    failed and the fix, and a traceback per process buried it (about 80 lines for a full disk).
    The process then ends at once, as a failed `notebook_launcher` task does: the exit
    handlers of the engines (JAX's shutdown barrier, a process group's teardown) wait for
    peers that are still inside a step, and JAX's ends in a C++ abort of 50 lines. A
    backup being written is left as a partial file, which the next start removes; the
    committed one is untouched. Other exceptions print and exit as before (through the
    hook already set; engines that set theirs later, as torch.distributed does, wrap this
    one). `one_line=False` (`KERAS_DIST_LOG=debug`) keeps tracebacks and exit handlers.
    Either way the notes of `note_failures_with` run first.
    """
    previous = sys.excepthook

    def print_one_line(kind, value, traceback):
        _run_failure_notes()
        if not one_line or not issubclass(kind, KerasDistError):
            previous(kind, value, traceback)
            return
        _write_one_line(value)
        os._exit(1)

    sys.excepthook = print_one_line


def end_process(error: KerasDistError) -> NoReturn:
    """Ends this process with `error`'s one line, as if it had been raised and not caught.

    For a thread of keras_dist's that finds the job failed while the main thread cannot
    raise it: that thread waits inside an engine that never returns (a parameter-server
    chief inside TensorFlow, for a frozen worker's step). The notes of
    `note_failures_with` run first; exit handlers do not (they would wait for the same
    engine), as after an uncaught error.

    Args:
        error: the error to report, e.g. a `PeerFailure`.
    """
    _run_failure_notes()
    _write_one_line(error)
    os._exit(1)


def _run_failure_notes() -> None:
    for note in _FAILURE_NOTES:
        with contextlib.suppress(Exception):
            note()


def _write_one_line(error: BaseException) -> None:
    # The process's own stderr: a wrapping hook would print what it captured only after this returns.
    sys.stdout.flush()
    sys.__stderr__.write(f"{type(error).__module__}.{type(error).__qualname__}: {error}\n")
    sys.__stderr__.flush()
