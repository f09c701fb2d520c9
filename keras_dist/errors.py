"""The exception types keras_dist raises: bad input or a bad environment, and a peer that stopped."""

from collections.abc import Sequence


class KerasDistError(RuntimeError):
    """A one-line message that says what is wrong and names the fix."""


def first_line(error: BaseException) -> str:
    """An engine's error in one line: its first, at most 200 characters (its type where it says nothing)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


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
    """

    def __init__(self, stopped: Sequence[str], within: str | None, fix: str, cause: str | None = None):
        self.stopped = list(stopped)
        who = ", ".join(self.stopped) or "a peer"
        said = f" ({cause.strip().splitlines()[0]})" if cause and cause.strip() else ""
        waited = f" within {within}" if within else ""
        super().__init__(f"{who} stopped answering{waited}{said}: its machine froze, lost its network or ended; {fix}")
