"""How long a process waits for the others before the job stops: one policy, every backend.

A frozen or cut-off machine never closes its connections, so without a bound its peers
wait for ever (torch's gloo waits 30 min, JAX's heartbeats 100 s, TensorFlow's parameter
servers for ever). Joining the job and the first steps trace or compile the step function
and start the input pipelines, on every process at its own pace; later ones are short.

`policy(settings)` is the one reading of the setting, built once per strategy and handed to its collectives; each strategy says what its engine makes of
it (`ProcessSetup.applied_step_timeout`), which docs/settings.md tabulates and
tests/test_settings.py checks against the code.
"""

import dataclasses

from keras_dist import settings

STEP_TIMEOUT_VARIABLE = "KERAS_DIST_STEP_TIMEOUT"
DEFAULT_FIRST_STEPS_SECONDS = 120.0
DEFAULT_LATER_STEPS_SECONDS = 30.0
# Steps (per worker) after which the shorter default applies.
FIRST_STEPS = 2


@dataclasses.dataclass(frozen=True)
class StepTimeout:
    """The step timeout as strategies receive it.

    Attributes:
        first: seconds to join the job and for each of the first `FIRST_STEPS` steps.
        later: seconds for each step after those.
        chosen: whether the user set it (`KERAS_DIST_STEP_TIMEOUT`, or a strategy's
            argument): then `first == later`.
    """

    first: float
    later: float
    chosen: bool


def policy(chosen: settings.Settings, explicit: float | None = None) -> StepTimeout:
    """The step timeout: `explicit` seconds, else `KERAS_DIST_STEP_TIMEOUT` (in `chosen`), else 120 then 30."""
    value = explicit or chosen.step_timeout
    if value:
        return StepTimeout(value, value, True)
    return StepTimeout(DEFAULT_FIRST_STEPS_SECONDS, DEFAULT_LATER_STEPS_SECONDS, False)
