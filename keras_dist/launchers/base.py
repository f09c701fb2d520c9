"""The launcher interface: what starts the processes of one script on this machine."""

import abc
from dataclasses import dataclass, field
from typing import ClassVar

from keras_dist.errors import KerasDistError
from keras_dist.launchers.nodes import Nodes


@dataclass
class Task:
    """One process of a local cluster.

    Args:
        name: the prefix of its output lines, e.g. `worker:1`.
        argv: the command line.
        env: variables added to the launcher's environment.
        prefix_output: False when the command prefixes lines itself (`horovodrun`).
        serves: a server (parameter-server workers and ps tasks): the job ends when
            every other task has, or, on a machine of servers only, when they have
            (they end with the chief); a server that dies does not stop the job (the
            chief decides whether it can go on).
    """

    name: str
    argv: list
    env: dict = field(default_factory=dict)
    prefix_output: bool = True
    serves: bool = False


class Launcher(abc.ABC):
    """Describes the processes of a local cluster: the environment variables through
    which each learns its place (read back by a `keras_dist.environments` class).

    `keras_dist.launchers.processes.run_tasks` starts them; a launcher only describes.
    """

    name: ClassVar[str] = ""
    # Whether its clusters include parameter-server tasks (then at least one).
    starts_parameter_servers: ClassVar[bool] = False

    def tasks(self, num_workers: int, num_ps: int, argv: list, nodes: Nodes | None = None) -> list:
        """The `Task`s that run `argv` (a script and its arguments) on this machine.

        Args:
            num_workers: training processes on this machine.
            num_ps: parameter-server tasks on this machine.
            argv: the script and its arguments.
            nodes: this machine's place in a job of several machines; None: this one only.
        """
        if self.starts_parameter_servers and num_ps < 1:
            raise KerasDistError(f"launcher {self.name!r} needs at least one parameter server; add --ps 1")
        if not self.starts_parameter_servers and num_ps:
            raise KerasDistError(f"launcher {self.name!r} starts no parameter servers; drop --ps")
        return self._tasks(num_workers, num_ps, argv, nodes if nodes and nodes.count > 1 else None)

    @abc.abstractmethod
    def _tasks(self, num_workers: int, num_ps: int, argv: list, nodes: Nodes | None) -> list:
        """`tasks` after its checks of the counts."""
