"""torchrun's variables on one host, without torchrun (`RANK`, `WORLD_SIZE`, `MASTER_ADDR`...); torchrun itself across machines."""

import os
import sys

from keras_dist.launchers.base import Launcher, Task
from keras_dist.launchers.processes import free_ports
from keras_dist.launchers.binding import binding_env


class TorchrunLauncher(Launcher):
    """One task per rank; rank 0 serves the rendezvous on a free loopback port.

    torch.distributed's TCP store listens on every interface whatever address it is
    given, and accepts any client; the loopback preload keeps it, and every other
    listener of the job, on 127.0.0.1.

    Across machines, PyTorch's own launcher: one `torchrun` per machine, its store at
    the master's address; the same preload keeps every listener of the job on the
    machine's cluster address.
    """

    name = "torchrun"

    def _tasks(self, num_workers, num_ps, argv, nodes):
        if nodes:
            # Machine 0 serves the store on its address, which its own name may not resolve to.
            master = nodes.address if nodes.rank == 0 else nodes.master
            return [Task(f"node:{nodes.rank}", [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(nodes.count),
                                                "--node-rank", str(nodes.rank), "--nproc-per-node", str(num_workers),
                                                "--master-addr", master, "--master-port", str(nodes.port), *argv],
                         env={"PYTHONUNBUFFERED": "1", **binding_env(os.environ, nodes.address)})]
        port = free_ports(1)[0]
        loopback = binding_env(os.environ, "127.0.0.1")
        return [
            Task(f"rank:{i}", [sys.executable, *argv],
                 env={"RANK": str(i), "WORLD_SIZE": str(num_workers), "LOCAL_RANK": str(i),
                      "LOCAL_WORLD_SIZE": str(num_workers), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                      "PYTHONUNBUFFERED": "1", **loopback})
            for i in range(num_workers)
        ]
