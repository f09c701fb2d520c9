"""The chief's step timeout, on a thread of its own: a frozen worker ends the job wherever the chief waits.

The chief waits for a frozen worker in two places. Openly, for a step's value; and inside
TensorFlow, in an eager operation of its own: the next batch of the arrays it reads, a
callback's variable read. The closure sent to the frozen worker never leaves TensorFlow's
executors, and such an operation waits for them (seen: the chief in `Executor.wait`
under `next()` on its `tf.data` iterator, worker 1 stopped, every process of the job
still up 180 s later and nothing printed; issue 58). A timeout kept by the chief's own
loop never fires there. So each step's value is fetched on a thread of its own, and one
watch thread times the oldest unfinished step: once it is later than the step timeout, the
chief's loop raises `PeerFailure` where it waits for a step (as an error of its own), and
anywhere else this process ends at once with the line that error prints, as its main
thread never comes back from TensorFlow.
"""

import collections
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Hashable
from typing import Any

from keras_dist import errors, timeouts
from keras_dist.errors import PeerFailure

logger = logging.getLogger("keras_dist")

_FIX = ("TensorFlow cannot go on without it: restart the job (BackupAndRestore resumes after the last epoch), or "
        f"raise {timeouts.STEP_TIMEOUT_VARIABLE} if steps are that slow")


class Step:
    """One scheduled closure: its `RemoteValue` and, once fetched, its value or error.

    Attributes:
        remote: the `RemoteValue` `ClusterCoordinator.schedule` returned.
        key: what its timeout depends on (the step function: the first runs trace it).
        finished: whether its value or error has arrived.
    """

    def __init__(self, remote: Any, key: Hashable):
        self.remote, self.key = remote, key
        self.finished = False
        self.value: Any = None
        self.error: BaseException | None = None
        self.since: float | None = None  # when it became the oldest unfinished step
        self.timeout: float | None = None  # seconds from `since`
        self.fetching = False


class StepWatch:
    """Times the oldest unfinished step of a `CoordinatedSteps`, on a thread of its own.

    The thread runs while steps are unfinished and ends when none is (a model compiled
    again gets a new watch; an idle one holds no thread). A step's clock starts when it
    becomes the oldest unfinished one: the steps behind it are queued, or wait for what
    it waits for.

    Args:
        step_timeout: seconds a step may take: `first` until steps of its function have
            finished `timeouts.FIRST_STEPS` times per worker (they trace it), then `later`.
        workers: how many worker tasks run the steps.
        stopped: names the tasks that stopped answering, given the late step's `RemoteValue`
            (probing the workers may take seconds: called off the lock).
        stalled: set once a step is late (the chief's exit then skips TensorFlow's teardown).
    """

    def __init__(self, step_timeout: timeouts.StepTimeout, workers: int, stopped: Callable[[Any], list[str]],
                 stalled: threading.Event):
        self.step_timeout = step_timeout
        self._workers = workers
        self._stopped = stopped
        self._stalled = stalled
        self._changed = threading.Condition(threading.Lock())
        self._steps: list[Step] = []  # scheduled and not yet taken by `value`, oldest first
        self._finished = collections.Counter()  # key -> steps that returned a value
        self._thread: threading.Thread | None = None
        self._failure: PeerFailure | None = None
        self._waiting = False  # whether the chief's loop waits in `value`
        self._ending = False  # the watch ends the process: the loop must not print the line too

    def add(self, remote: Any, key: Hashable, oldest: bool = False) -> Step:
        """Watches a scheduled closure's `RemoteValue`; `oldest`: a step scheduled again, ahead of the others."""
        step = Step(remote, key)
        with self._changed:
            if oldest:
                for later in self._steps:  # their clocks start again once the step ahead of them ends
                    later.since = None
                self._steps.insert(0, step)
            else:
                self._steps.append(step)
            if self._thread is None and self._failure is None:
                self._thread = threading.Thread(target=self._watch, name="keras_dist-step-watch", daemon=True)
                self._thread.start()
            self._changed.notify_all()
        return step

    def value(self, step: Step) -> Any:
        """The fetched value of `step` (added before), waiting for it.

        Raises:
            PeerFailure: a step was later than the step timeout (this one or another).
            Exception: what fetching it raised (a worker lost mid-step: TensorFlow's error).
        """
        with self._changed:
            self._waiting = True
            try:
                self._changed.wait_for(lambda: not self._ending and (step.finished or self._failure is not None))
            finally:
                self._waiting = False
            if self._failure is not None:
                raise self._failure
            self._steps.remove(step)
        if step.error is not None:
            raise step.error
        return step.value

    def _timeout(self, key: Hashable) -> float:
        if self._finished[key] >= timeouts.FIRST_STEPS * self._workers:
            return self.step_timeout.later
        return self.step_timeout.first

    def _watch(self) -> None:
        while True:
            late = self._wait_for_a_late_step()
            if late is None:
                return
            stopped = self._stopped(late.remote)
            with self._changed:
                if late.finished:  # while the workers were probed
                    continue
                self._failure = PeerFailure(stopped, f"{late.timeout:g} s", _FIX, cause="a step did not finish")
                self._stalled.set()
                if self._waiting:  # the loop raises it
                    self._changed.notify_all()
                    return
                self._ending = True
            _end_process(self._failure)
            return

    def _wait_for_a_late_step(self) -> Step | None:
        """The oldest unfinished step once it is late; None (and the thread ends) once every step has finished."""
        with self._changed:
            while True:
                oldest = next((step for step in self._steps if not step.finished), None)
                if oldest is None:
                    self._thread = None
                    return None
                now = time.monotonic()
                if oldest.since is None:
                    oldest.since, oldest.timeout = now, self._timeout(oldest.key)
                if not oldest.fetching:
                    oldest.fetching = True
                    # `fetch` blocks until the step ends, for ever on a frozen worker: on a thread of its
                    # own, which is then left waiting (a daemon: the process ends without it).
                    threading.Thread(target=self._fetch, args=(oldest,), name="keras_dist-fetch", daemon=True).start()
                left = oldest.since + oldest.timeout - now
                if left <= 0:
                    return oldest
                self._changed.wait(left)

    def _fetch(self, step: Step) -> None:
        try:
            value, error = step.remote.fetch(), None
        except Exception as exc:  # handed to the loop, whatever it is
            value, error = None, exc
        with self._changed:
            step.value, step.error, step.finished = value, error, True
            if error is None:
                self._finished[step.key] += 1
            self._changed.notify_all()


def _end_process(failure: PeerFailure) -> None:
    """Ends this process with `failure`'s one line (`errors.end_process`): its main thread waits
    inside TensorFlow and would never raise it. Where the chief waited goes to the debug log
    (`KERAS_DIST_LOG=debug`)."""
    main = sys._current_frames().get(threading.main_thread().ident)
    if main is not None:
        logger.debug("keras_dist: the chief's main thread waited in\n%s", "".join(traceback.format_stack(main)))
    errors.end_process(failure)
