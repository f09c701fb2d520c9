"""Epoch logs as Keras shows them: nested results flattened, metric results from summed states.

Shared by the trainers that make logs global themselves (`training`, and the
parameter-server loop, which runs Keras's steps remotely).
"""

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from keras import tree

if TYPE_CHECKING:
    import keras


def flat_logs(logs: Mapping[str, Any]) -> dict[str, Any]:
    """Logs with nested dicts (a `CompileMetrics` result) merged in, as Keras shows them."""
    flat = {}
    for name, value in logs.items():
        if isinstance(value, dict):
            flat.update(flat_logs(value))
        else:
            flat[name] = value
    return flat


def metric_results(metrics: Iterable["keras.metrics.Metric"], states: Iterable[Any]) -> dict[str, Any]:
    """`{name: value}` of `metrics` computed from `states`, their variables' values in order.

    Args:
        metrics: `model.metrics`.
        states: one value per metric variable, e.g. states summed over replicas.
    """
    states = list(states)
    results = {}
    for metric in metrics:
        count = len(metric.variables)
        own, states = states[:count], states[count:]
        result = metric.stateless_result(own)
        # A `result()` that returns a state variable itself escapes stateless_result's mapping.
        by_variable = {id(v): value for v, value in zip(metric.variables, own)}
        result = tree.map_structure(lambda r: by_variable.get(id(r), r), result)
        if isinstance(result, dict):
            results.update(result)
        else:
            results[metric.name] = result
    return results
