"""TF_CONFIG, the cluster description every `tf.distribute` multi-process backend reads.

Backend-agnostic: the multi-worker and parameter-server backends both parse it here, so
a malformed TF_CONFIG gets the same one-line error whichever backend reads it.
"""

import json

from keras_dist.errors import KerasDistError

_EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'


def parse_tf_config(text):
    """`(cluster, task_type, task_index)` from a TF_CONFIG string, with one-line errors.

    Args:
        text: the value of the TF_CONFIG environment variable.

    Example:

    ```python
    cluster, kind, index = parse_tf_config(os.environ["TF_CONFIG"])
    ```
    """
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise KerasDistError(f"TF_CONFIG is not valid JSON ({exc}); set it like {_EXAMPLE}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise KerasDistError(f'TF_CONFIG has no "cluster" object; set it like {_EXAMPLE}')
    cluster = config["cluster"]
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise KerasDistError('TF_CONFIG has no "task"; add "task": {"type": "worker", "index": N} for this process')
    kind, index = task["type"], task.get("index", 0)
    if kind not in cluster:
        raise KerasDistError(f"TF_CONFIG task type {kind!r} is not in its cluster ({', '.join(cluster)}); use one of those")
    if not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
        raise KerasDistError(
            f"TF_CONFIG task index {index!r} is out of range: the cluster has {len(cluster[kind])} "
            f"{kind!r} tasks; use an index from 0 to {len(cluster[kind]) - 1}"
        )
    addresses = [a for tasks in cluster.values() for a in tasks]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise KerasDistError(f"TF_CONFIG lists {duplicates[0]} more than once; give every task its own host:port")
    return cluster, kind, index
