"""The one exception type keras_dist raises for bad input or a bad environment."""


class KerasDistError(RuntimeError):
    """A one-line message that says what is wrong and names the fix."""
