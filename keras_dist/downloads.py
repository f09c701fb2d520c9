"""The script's downloads in a job of several processes: once per machine.

A script fetches its data with `keras.utils.get_file` (`keras.datasets.*.load_data` call
it too), and every process runs the script: on one machine they all downloaded into
the same cache at once, and extracted the same archive over each other (keras.io's
traffic forecasting example: `FileExistsError` on one worker while the other extracted).
keras_dist patches no Keras function. A Python audit hook, installed once per process of
a job, sees the first thing `get_file` does, `os.makedirs` of its cache directory, and
from there the processes of one machine take their turns at that directory:

* the first to arrive downloads and extracts as Keras does; the others wait for it
  (a line every `_REPORT_SECONDS`), then run `get_file` in turn, which finds the file
  downloaded. Keras extracts an archive again on every call: each waiting process
  extracts it again, in turn.
* a process that has run `get_file` then waits until no other process of the machine is
  inside `get_file` for that directory, so that nobody reads the extracted files while
  another process rewrites them. A process that reaches `get_file` after the others
  have left it extracts it again while they may read it, as two plain scripts would.
* where one process's download failed, each of the others that reaches the same
  `get_file` since it started stops with one line, instead of trying again.

TensorFlow Datasets' `tfds.load` is not covered: it asks whether its data set is
prepared, and builds its splits from the answer, before its first audit event, so a
process that waited there would read the splits of a data set not yet prepared.

The turns are `flock`s on files of keras_dist's in this machine's temporary directory
(`$TMPDIR/keras_dist-UID/downloads`), one pair per cache directory, so they are per
machine: machines sharing one file system each download once. The turns hold a
process only while it is inside `get_file` (a profile function for that thread, while
the call runs, tells its return).
"""

import contextlib
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from keras_dist.errors import KerasDistError

logger = logging.getLogger("keras_dist")
_REPORT_SECONDS = 30.0
_POLL_SECONDS = 0.05
# When this process started: a failure recorded before then is a run before's.
_STARTED = time.time()
_CLOCK_SLACK_SECONDS = 1.0


class _Turn:
    """One process's turn at a cache directory: the download lock (exclusive, while it runs
    `get_file`) and the gate (shared while inside `get_file`; exclusive, briefly, on leaving:
    the others have left)."""

    def __init__(self, directory: str, origin: str) -> None:
        locks = os.path.join(tempfile.gettempdir(), f"keras_dist-{os.getuid()}", "downloads")
        os.makedirs(locks, mode=0o700, exist_ok=True)
        name = hashlib.sha256(os.path.realpath(directory).encode()).hexdigest()[:32]
        self.directory, self.origin = directory, origin
        self.lock = os.open(os.path.join(locks, f"{name}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        self.gate = os.open(os.path.join(locks, f"{name}.gate"), os.O_RDWR | os.O_CREAT, 0o600)

    def take(self) -> None:
        """Returns once this process may run `get_file`; one line if another process of this job
        failed to download the same file."""
        import fcntl  # POSIX only: `once_per_machine` hooks nothing where it is missing

        fcntl.flock(self.gate, fcntl.LOCK_SH)
        _flock_waiting(self.lock, f"another process of this machine downloading into {self.directory}")
        if self._failed_elsewhere():
            self.leave()
            raise KerasDistError(f"the download of {self.origin} failed in another process of this machine (its "
                                 "error says why); this one stops too: fix the address or the network, or download "
                                 "it once before the job starts")

    def _failed_elsewhere(self) -> bool:
        """Whether another process failed to download this file since this process started
        (a run before's failure is no concern of this one's)."""
        failed = self._failures().get(self.origin)
        return failed is not None and failed[0] != os.getpid() and failed[1] >= _STARTED - _CLOCK_SLACK_SECONDS

    def _failures(self) -> dict[str, list]:
        """The downloads into this directory that failed the last time they were tried: origin -> [pid, time]."""
        try:
            failures = json.loads(os.pread(self.lock, 1 << 20, 0) or b"{}")
        except ValueError:
            return {}
        return failures if isinstance(failures, dict) else {}

    def give_back(self, downloaded: bool) -> None:
        """Records how this turn ended, lets the next process in, and waits for those inside to leave."""
        failures = self._failures()
        if downloaded:
            failures.pop(self.origin, None)
        else:
            failures[self.origin] = [os.getpid(), time.time()]
        os.ftruncate(self.lock, 0)
        os.pwrite(self.lock, json.dumps(failures).encode(), 0)
        import fcntl

        fcntl.flock(self.lock, fcntl.LOCK_UN)
        fcntl.flock(self.gate, fcntl.LOCK_UN)
        _flock_waiting(self.gate, f"the other processes of this machine running get_file into {self.directory}")
        self.leave()

    def leave(self) -> None:
        for descriptor in (self.lock, self.gate):
            with contextlib.suppress(OSError):
                os.close(descriptor)  # closing lets go of its lock too


def _flock_waiting(descriptor: int, waiting_for: str) -> None:
    """Takes an exclusive lock on `descriptor`, with a line every `_REPORT_SECONDS` while it waits."""
    import fcntl

    started = reported = time.monotonic()
    while True:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now - reported >= _REPORT_SECONDS:
                # A warning: on a process other than the chief, informational lines do not show.
                logger.warning("keras_dist: waiting %.0f s so far for %s", now - started, waiting_for)
                reported = now
            time.sleep(_POLL_SECONDS)


# Per thread: whether it is inside a `get_file` it took its turn for (or taking one).
_IN_TURN = threading.local()
_HOOKED: list[bool] = []


def once_per_machine() -> None:
    """Makes `keras.utils.get_file` run in turn across the processes of this machine (see the
    module docstring); for a process of a job of several processes."""
    try:
        import fcntl  # noqa: F401 -- POSIX only; elsewhere the processes download as without keras_dist
    except ImportError:
        return
    if not _HOOKED:
        sys.addaudithook(_on_audit_event)  # cannot be removed; costs a comparison per audit event
        _HOOKED.append(True)


def _on_audit_event(event: str, args: tuple) -> None:
    if event != "os.mkdir" or getattr(_IN_TURN, "inside", False):
        return
    # From here on, what this hook does raises audit events too (`sys._getframe`, making the
    # lock files' directory): they return at the line above.
    _IN_TURN.inside = True
    try:
        frame = _get_file_making_its_directory(args[0])
        if frame is None:
            _IN_TURN.inside = False
            return
        turn = _Turn(frame.f_locals["datadir"], str(frame.f_locals.get("origin")))
        turn.take()
    except BaseException:
        _IN_TURN.inside = False
        raise
    previous_profile = sys.getprofile()

    def on_return(called: FrameType, event: str, value: Any) -> None:
        if previous_profile is not None:
            previous_profile(called, event, value)
        if called is frame and event == "return":
            sys.setprofile(previous_profile)
            try:
                # `get_file` returns its path; it leaves with None only by raising.
                turn.give_back(downloaded=value is not None)
            finally:
                _IN_TURN.inside = False  # after: the frame is still on the stack while it returns

    # A profile function, for this thread and only while the call runs: its return, at once.
    sys.setprofile(on_return)


def _get_file_making_its_directory(path: Any) -> FrameType | None:
    """The frame of Keras's `get_file` if this `os.mkdir` is its `os.makedirs` of its cache directory."""
    from keras_dist import keras_internals

    target = keras_internals.loaded_get_file_code()
    if target is None or not isinstance(path, (str, bytes, os.PathLike)):
        return None
    path = os.fsdecode(path)
    frame = sys._getframe(1).f_back
    for _ in range(8):  # os.makedirs, recursing once per missing parent
        if frame is None:
            return None
        if frame.f_code is target:
            return frame if frame.f_locals.get("datadir") == path else None
        frame = frame.f_back
    return None
