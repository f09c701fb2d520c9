"""`TF_CONFIG` clusters: tf.distribute's multi-worker and parameter-server jobs, on one machine or several."""

import json
import os
import sys

from keras_dist.launchers.base import Launcher, Task
from keras_dist.launchers.processes import free_ports
from keras_dist.launchers.binding import binding_env


class TFConfigLauncher(Launcher):
    """`worker` tasks only, each with its own `TF_CONFIG` (worker 0 is the chief).

    Across machines each machine runs its `-n` tasks on its own address; the machines
    learn each other's addresses and ports through the master (`Nodes.exchange`).
    """

    name = "tf_config"
    # Task kinds that serve until stopped rather than run the script to its end.
    serving_kinds = ()

    def _counts(self, num_workers, num_ps, first):
        """Tasks per kind on one machine; `first`: the machine of the chief."""
        return {"worker": num_workers}

    def _tasks(self, num_workers, num_ps, argv, nodes):
        address = nodes.address if nodes else "127.0.0.1"
        counts = self._counts(num_workers, num_ps, first=not nodes or nodes.rank == 0)
        ports = iter(free_ports(sum(counts.values()), address))
        mine = {kind: [f"{address}:{next(ports)}" for _ in range(count)] for kind, count in counts.items()}
        machines = nodes.exchange(mine) if nodes else [mine]
        cluster = {kind: [a for machine in machines for a in machine.get(kind, [])] for kind in ("chief", "worker", "ps")}
        cluster = {kind: tasks for kind, tasks in cluster.items() if tasks}
        # TensorFlow's servers listen on this machine's cluster address only; set up
        # front, it spares each task a restart.
        binding = binding_env(os.environ, address)
        places = [(kind, cluster[kind].index(task)) for kind, tasks in mine.items() for task in tasks]
        return [
            Task(f"{kind}:{index}", [sys.executable, *argv], serves=kind in self.serving_kinds,
                 env={"TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": kind, "index": index}}), **binding})
            for kind, index in places
        ]


class TFConfigParameterServerLauncher(TFConfigLauncher):
    """A `chief` that runs the script (on the first machine), `worker` tasks and `ps`
    tasks that serve until the chief is done."""

    name = "tf_config_with_ps"
    starts_parameter_servers = True
    serving_kinds = ("worker", "ps")

    def _counts(self, num_workers, num_ps, first):
        return {"chief": 1 if first else 0, "worker": num_workers, "ps": num_ps}
