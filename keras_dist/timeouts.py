"""How long a step waits for the other processes before the job stops: one setting for every backend.

A frozen or cut-off machine never closes its connections, so without a bound its peers
wait for ever (torch's gloo waits 30 min, JAX's heartbeats 100 s, TensorFlow's parameter
servers for ever). The first steps also trace or compile the step function and start the
input pipelines, on every process at its own pace; later ones are short (Horovod's own
collective timeout is 30 s).
"""

from keras_dist import settings

STEP_TIMEOUT_VAR = "KERAS_DIST_STEP_TIMEOUT"
DEFAULT_FIRST_STEP_TIMEOUT = 120.0
DEFAULT_STEP_TIMEOUT = 30.0
# Steps (per worker) after which the shorter default applies.
FIRST_STEPS = 2


def chosen(explicit: float | None = None) -> float | None:
    """The user's step timeout in seconds: `explicit`, else `KERAS_DIST_STEP_TIMEOUT`; None: the defaults."""
    return explicit or settings.current().step_timeout


def first_steps(explicit: float | None = None) -> float:
    """Seconds a process may wait at start-up and in the first steps."""
    return chosen(explicit) or DEFAULT_FIRST_STEP_TIMEOUT


def later_steps(explicit: float | None = None) -> float:
    """Seconds a process may wait in a step after the first ones."""
    return chosen(explicit) or DEFAULT_STEP_TIMEOUT
