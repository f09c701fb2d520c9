"""What a job prints before its first epoch: one line from keras_dist, nothing from TensorFlow's start.

A job of N processes would otherwise print TensorFlow's start-up lines N times, and
keras_dist's own informational lines once per process. The policy:

- TensorFlow's informational C++ lines are off where the user set nothing
  (`TF_CPP_MIN_LOG_LEVEL=1`, set only where unset and before TensorFlow is imported);
  its warnings and errors still show. Two lines ignore that level in TensorFlow 2.21 (the
  "oneDNN custom operations are on" line and absl's "before absl::InitializeLog()" line):
  `keras-dist launch` drops them from its tasks' output.
- keras_dist's chief logs one summary line per job (backend, strategy, replicas,
  machines) and its informational lines; other processes log warnings only.
- `KERAS_DIST_LOG=debug` shows everything, on every process.

Logging is configured only where the script configured none (no handler on the root or
`keras_dist` logger), so a script's own `logging.basicConfig` keeps control.
"""

import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

from keras_dist import settings

if TYPE_CHECKING:
    from keras_dist.replicas import Replicas

TF_LOG_LEVEL_VARIABLE = "TF_CPP_MIN_LOG_LEVEL"

# Start-up lines that no setting silences: TensorFlow's that `TF_CPP_MIN_LOG_LEVEL` does not reach (2.21).
_START_UP_LINES = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|^I\d{4} [\d:.]+ +\d+ port\.cc:\d+\] oneDNN custom operations are on"
    # Gloo's note, from each process of a JAX job, that it reached its peers.
    r"|^\[Gloo\] Rank \d+ is connected to \d+ peer ranks"
)

logger = logging.getLogger("keras_dist")


def quiet_tensorflow_variables(variables: Mapping[str, str], chosen: settings.Settings) -> dict[str, str]:
    """The variable that turns TensorFlow's informational C++ lines off in the process whose
    environment is `variables`, where unset and `chosen` (its settings) asks for no debugging lines.

    Set it before that process imports TensorFlow: TensorFlow reads the level once.
    """
    return {TF_LOG_LEVEL_VARIABLE: "1"} if not chosen.debug_log and TF_LOG_LEVEL_VARIABLE not in variables else {}


def is_start_up_line(line: str) -> bool:
    """Whether `line` of a task's output is a framework start-up line that no setting silences."""
    return _START_UP_LINES.search(line) is not None


def configure_logging(is_chief: bool) -> None:
    """Shows keras_dist's lines on stderr: informational ones from the chief, warnings from all."""
    if logging.getLogger().handlers or logger.handlers:
        return  # the script (or a test) configured logging itself
    level = logging.DEBUG if settings.current().debug_log else logging.INFO if is_chief else logging.WARNING
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(level)


def announce(replicas: "Replicas") -> None:
    """The job's one summary line, from the chief of a job of several processes or replicas."""
    if replicas.size == 1 and replicas.num_replicas == 1:
        if replicas.environment.name != "local":
            # A launcher's job of one process (an elastic job down to one machine): its
            # lines on resuming, without the summary line.
            configure_logging(is_chief=True)
        return  # one plain process prints what it printed without keras_dist
    configure_logging(replicas.is_chief)
    environment = replicas.environment
    where = ""
    if environment.KNOWS_LOCAL_SIZE:
        machines = -(-replicas.size // max(1, environment.local_size))
        where = f" on {machines} machine{'' if machines == 1 else 's'}"
    logger.info("keras_dist: %s backend (%s): %d replicas in %d process%s%s (cluster environment: %s)",
                replicas.name, type(replicas).__name__, replicas.num_replicas, replicas.size,
                "" if replicas.size == 1 else "es", where, environment.name or "none")
    logger.debug("keras_dist: this process is %s", replicas.describe())
