"""`TF_CONFIG` clusters on loopback: tf.distribute's multi-worker and parameter-server jobs."""

import json
import os
import sys

from keras_dist.launchers.base import Launcher, Task
from keras_dist.launchers.processes import free_loopback_ports
from keras_dist.tf_cluster import binding_env


class TFConfigLauncher(Launcher):
    """`worker` tasks only, each with its own `TF_CONFIG` (worker 0 is the chief)."""

    name = "tf_config"
    # Task kinds that serve until stopped rather than run the script to its end.
    serving_kinds = ()

    def _cluster(self, num_workers, num_ps):
        return {"worker": [f"127.0.0.1:{port}" for port in free_loopback_ports(num_workers)]}

    def _tasks(self, num_workers, num_ps, argv):
        cluster = self._cluster(num_workers, num_ps)
        # TensorFlow's servers listen on loopback only; set up front, it spares each task a restart.
        loopback = binding_env(os.environ, "127.0.0.1")
        return [
            Task(f"{kind}:{i}", [sys.executable, *argv], serves=kind in self.serving_kinds,
                 env={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": i}}), **loopback})
            for kind in ("chief", "worker", "ps") for i in range(len(cluster.get(kind, [])))
        ]


class TFConfigParameterServerLauncher(TFConfigLauncher):
    """A `chief` that runs the script, `worker` tasks and `ps` tasks that serve until stopped."""

    name = "tf_config_with_ps"
    starts_parameter_servers = True
    serving_kinds = ("worker", "ps")

    def _cluster(self, num_workers, num_ps):
        ports = iter(free_loopback_ports(1 + num_workers + num_ps))
        return {"chief": [f"127.0.0.1:{next(ports)}"],
                "worker": [f"127.0.0.1:{next(ports)}" for _ in range(num_workers)],
                "ps": [f"127.0.0.1:{next(ports)}" for _ in range(num_ps)]}
