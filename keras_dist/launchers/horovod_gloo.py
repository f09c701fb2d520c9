"""Horovod's Gloo rendezvous, served from the launcher on loopback: `horovodrun --gloo` for one host."""

import sys
import threading

from keras_dist.errors import KerasDistError
from keras_dist.launchers.base import Launcher, Task


class HorovodGlooLauncher(Launcher):
    """One task per rank, with the variables `horovodrun --gloo` gives its workers.

    `horovodrun` would serve the rendezvous store on every interface (0.0.0.0) for the
    whole job; a local cluster needs 127.0.0.1 only. The ranks are then direct children
    of the launcher, which names, stops and reports each of them.
    """

    name = "horovod_gloo"

    def _tasks(self, num_workers, num_ps, argv, nodes):
        if nodes:
            raise KerasDistError("keras-dist launch --nnodes does not start Horovod; across machines run `horovodrun "
                                 "-np N -H host1:n,host2:n --gloo python train.py` on one of them (see docs)")
        try:
            from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
            from horovod.runner.gloo_run import create_run_env_vars, create_slot_env_vars
            from horovod.runner.http.http_server import RendezvousHandler, RendezvousHTTPServer
        except ImportError:
            raise KerasDistError("Horovod is not installed; build it with tools/build_horovod.sh") from None
        slots = get_host_assignments(parse_hosts(f"localhost:{num_workers}"), num_workers)
        store = RendezvousHTTPServer(("127.0.0.1", 0), RendezvousHandler, False)
        store.init(slots)
        threading.Thread(target=store.serve_forever, name="keras_dist-gloo-rendezvous", daemon=True).start()
        job = create_run_env_vars("127.0.0.1", ["lo"], store.server_address[1])  # Gloo's own sockets: loopback too
        return [
            Task(f"rank:{slot.rank}", [sys.executable, *argv],
                 env={**{k: str(v) for k, v in {**job, **create_slot_env_vars(slot)}.items()}, "PYTHONUNBUFFERED": "1"})
            for slot in slots
        ]
