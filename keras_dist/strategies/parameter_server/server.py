"""What a parameter-server job's worker and ps tasks run: a TensorFlow server, nothing else."""

import sys

import tensorflow as tf

from keras_dist.errors import KerasDistError
from keras_dist.tf_cluster import parse_tf_config

SERVING_TASKS = ("worker", "ps")


def ps_cluster(environ):
    """`(cluster, task_type, index)` of a TF_CONFIG that lists ps tasks, with one-line errors."""
    cluster, kind, index = parse_tf_config(environ.get("TF_CONFIG", ""))
    if not cluster.get("ps") or not cluster.get("worker"):
        raise KerasDistError("backend 'parameter_server' needs TF_CONFIG with 'ps' and 'worker' tasks; "
                             "launch with `keras-dist launch --backend parameter_server -n WORKERS --ps K`")
    if kind not in ("chief", *SERVING_TASKS):
        raise KerasDistError(f"backend 'parameter_server' has no {kind!r} task; run evaluation on the chief "
                             "(validation_data) and drop it from TF_CONFIG")
    if len(cluster.get("chief", [])) != 1:
        raise KerasDistError("backend 'parameter_server' needs exactly one 'chief' task in TF_CONFIG: "
                             "it runs the script and schedules the steps")
    return cluster, kind, index


def serve(cluster, kind, index):
    """Runs this process as TF_CONFIG's `kind:index` server until it is killed.

    Args:
        cluster: TF_CONFIG's cluster dict.
        kind: "worker" or "ps".
        index: the task index.
    """
    server = tf.distribute.Server(tf.train.ClusterSpec(cluster), job_name=kind, task_index=index,
                                  protocol="grpc", start=True)
    print(f"keras_dist: {kind}:{index} serving at {cluster[kind][index]} for the chief", file=sys.stderr, flush=True)
    server.join()
