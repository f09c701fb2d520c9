"""A job on several machines: `keras-dist launch --nnodes N --node-rank I --master-addr HOST[:PORT]`.

The same command runs once on each machine. JAX and PyTorch need only the master's
address (their coordinator, or torchrun's store, runs there). A `TF_CONFIG` names every
task's address, which no machine knows of the others: machine 0's launcher serves a
small directory at the master's address, where each machine's launcher publishes its
address and ports and reads everyone's (`Nodes.exchange`), as torchrun's c10d store does.
"""

import json
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from keras_dist import network
from keras_dist.errors import KerasDistError

DEFAULT_PORT = 29400
# Seconds a machine waits for the others to join (they start by hand, or by a scheduler).
JOIN_SECONDS = 600.0


@dataclass(frozen=True)
class Nodes:
    """This machine's place in a job of several.

    Args:
        count: machines in the job.
        rank: this machine's index, 0 for the master.
        master: the master's host name or address, as every machine reaches it.
        port: the master's port: the engine's coordinator (JAX, torchrun's store) or
            keras_dist's directory (TensorFlow's clusters).
        attempt: how many times the job has been restarted (`--max-restarts`).
    """

    count: int
    rank: int
    master: str
    port: int = DEFAULT_PORT
    attempt: int = 0

    @classmethod
    def parse(cls, count: int, rank: int, master: str | None) -> "Nodes":
        """From the command line, with one-line errors."""
        if count < 1:
            raise KerasDistError(f"--nnodes must be at least 1, got {count}")
        if not 0 <= rank < count:
            raise KerasDistError(f"--node-rank must be from 0 to {count - 1} with --nnodes {count}, got {rank}")
        if not master:
            raise KerasDistError("--nnodes needs --master-addr HOST[:PORT], the machine of --node-rank 0, "
                                 "as every machine reaches it")
        host, _, port = master.rpartition(":") if master.count(":") == 1 or master.startswith("[") else ("", "", "")
        if host and not port.isdigit():
            raise KerasDistError(f"--master-addr {master!r}: the port must be a number; write HOST:PORT")
        return cls(count, rank, (host or master).strip("[]"), int(port) if host else DEFAULT_PORT)

    @property
    def address(self) -> str:
        """This machine's address as the other machines reach it (never a loopback name)."""
        address = network.job_address(self.master)
        if address is None:
            raise KerasDistError(f"this machine has no route to the master {self.master}; check --master-addr")
        return address

    @property
    def master_address(self) -> str:
        return f"{self.master}:{self.port}"

    def exchange(self, value: dict) -> list:
        """Publishes `value` for this machine and returns every machine's, in rank order.

        Machine 0 serves the directory until its launcher ends (`serve_directory`).
        """
        # Machine 0 by the address it serves on: its own name may resolve to loopback there.
        url = f"http://{self.address if self.rank == 0 else self.master}:{self.port}/{self.attempt}"
        body = json.dumps(value).encode()
        direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never through a proxy
        deadline = time.monotonic() + JOIN_SECONDS
        while True:
            try:
                direct.open(urllib.request.Request(f"{url}/{self.rank}", data=body, method="PUT"), timeout=10)
                found = json.loads(direct.open(url, timeout=10).read())
                if len(found) == self.count:
                    return [found[str(rank)] for rank in range(self.count)]
            except (urllib.error.URLError, OSError):
                pass  # the master's launcher is not up yet
            if time.monotonic() > deadline:
                raise KerasDistError(f"not every machine joined at {self.master_address} within {JOIN_SECONDS:g} s; run "
                                     f"`keras-dist launch --nnodes {self.count} --node-rank I --master-addr "
                                     f"{self.master_address} ...` on each machine, I from 0 to {self.count - 1}")
            time.sleep(0.2)


def serve_directory(nodes: Nodes) -> ThreadingHTTPServer:
    """On machine 0: the directory `Nodes.exchange` reads, on the master's address only, until shut down."""
    entries = {}
    lock = threading.Lock()

    class Directory(BaseHTTPRequestHandler):
        def do_PUT(self):
            attempt, _, rank = self.path.strip("/").partition("/")
            value = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with lock:
                entries.setdefault(attempt, {})[rank] = value
            self._reply(b"{}")

        def do_GET(self):
            with lock:
                self._reply(json.dumps(entries.get(self.path.strip("/"), {})).encode())

        def _reply(self, body):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass  # one line per request is noise in the job's output

    try:
        server = ThreadingHTTPServer((nodes.address, nodes.port), Directory)
    except OSError as exc:
        raise KerasDistError(f"machine 0 cannot listen at {nodes.address}:{nodes.port} ({exc.strerror}); "
                             "pick another port in --master-addr HOST:PORT") from None
    threading.Thread(target=server.serve_forever, name="keras_dist-directory", daemon=True).start()
    return server

