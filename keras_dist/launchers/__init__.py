"""Launchers: each starts one kind of local cluster for `keras-dist launch`.

A launcher sets the variables a cluster environment (`keras_dist.environments`) reads
back in every task, and nothing else: which strategy trains there is the strategy's
business (each entry of `keras_dist.strategies.REGISTRY` names the launcher that starts
its clusters).

Adding a launcher adds one module here and one line to `REGISTRY`.
"""

import importlib

from keras_dist.errors import KerasDistError
from keras_dist.launchers.base import Launcher, Task

# name -> "module:Class"; imported only when used (Horovod's runner is not light).
REGISTRY = {
    "horovod_gloo": "keras_dist.launchers.horovod_gloo:HorovodGlooLauncher",
    "tf_config": "keras_dist.launchers.tf_config:TFConfigLauncher",
    "tf_config_with_ps": "keras_dist.launchers.tf_config:TFConfigParameterServerLauncher",
    "torchrun": "keras_dist.launchers.torchrun:TorchrunLauncher",
    "keras_distribution": "keras_dist.launchers.keras_distribution:KerasDistributionLauncher",
}

# Launchers whose machines learn each other's addresses through the master
# (`Nodes.exchange`), a directory machine 0's `keras-dist launch` serves; the others need
# the master's address only.
EXCHANGING = frozenset({"horovod_gloo", "tf_config", "tf_config_with_ps"})


def create(name: str) -> Launcher:
    """The launcher registered under `name`."""
    if name not in REGISTRY:
        raise KerasDistError(f"unknown launcher {name!r}; choose one of: {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["EXCHANGING", "REGISTRY", "Launcher", "Task", "create"]
