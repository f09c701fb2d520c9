"""Horovod's Gloo rendezvous, served by the launcher: `horovodrun --gloo` without ssh, on one machine or several."""

import os
import sys
import threading

from keras_dist import network
from keras_dist.errors import KerasDistError
from keras_dist.launchers.base import Launcher, Task
from keras_dist.launchers.binding import binding_env


class HorovodGlooLauncher(Launcher):
    """One task per rank, with the variables `horovodrun --gloo` gives its workers.

    `horovodrun` would serve the rendezvous store on every interface (0.0.0.0) for the
    whole job; a local cluster needs 127.0.0.1 only. The ranks are then direct children
    of the launcher, which names, stops and reports each of them.

    Across machines, machine 0's launcher serves the store on its cluster address. The
    machines learn each other's addresses, rank counts and the store's port through the
    master (`Nodes.exchange`), so each machine's name is its address (Horovod's
    `HOROVOD_HOSTNAME`, which its peers must reach), and every listener of the job binds
    to the machine's cluster address.
    """

    name = "horovod_gloo"

    def _tasks(self, num_workers, num_ps, argv, nodes):
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
            from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        except ImportError:
            raise KerasDistError("Horovod is not installed; build it with keras-dist build-horovod") from None
        address = nodes.address if nodes else "127.0.0.1"
        store = RendezvousHTTPServer((address, 0), RendezvousHandler, False) if not nodes or nodes.rank == 0 else None
        mine = {"host": address if nodes else "localhost", "ranks": num_workers,
                "store": store.server_address[1] if store else None}
        machines = nodes.exchange(mine) if nodes else [mine]
        hosts = ",".join(f"{machine['host']}:{machine['ranks']}" for machine in machines)
        slots = get_host_assignments(parse_hosts(hosts), sum(machine["ranks"] for machine in machines))
        if store is not None:
            store.init(slots)
            threading.Thread(target=store.serve_forever, name="keras_dist-gloo-rendezvous", daemon=True).start()
        if nodes:
            # Gloo's own sockets on the user's interface, else the one that holds the cluster address.
            interface = os.environ.get("HOROVOD_GLOO_IFACE") or network.interface_of(address)
            if interface is None:
                raise KerasDistError(f"no interface holds {address}; set HOROVOD_GLOO_IFACE to the interface "
                                     "the other machines reach this one on")
            job = create_run_env_vars(machines[0]["host"], [interface], machines[0]["store"])
            job.update(binding_env(os.environ, address))
        else:
            job = create_run_env_vars("127.0.0.1", ["lo"], store.server_address[1])  # Gloo's own sockets: loopback too
        return [
            Task(f"rank:{slot.rank}", [sys.executable, *argv],
                 env={**{k: str(v) for k, v in {**job, **create_slot_env_vars(slot)}.items()}, "PYTHONUNBUFFERED": "1"})
            for slot in slots if slot.hostname == mine["host"]
        ]
