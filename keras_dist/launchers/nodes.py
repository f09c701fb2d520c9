"""A job on several machines: `keras-dist launch --nnodes N --node-rank I --master-addr HOST[:PORT]`.

With `--nnodes MIN:MAX` the job is elastic: at each start and restart the machines that
answer assemble at the master (`Nodes.assemble`), all MAX, or at least MIN after
`ELASTIC_WAIT_SECONDS`, and the job runs on those, ranked in node-rank order; a machine
that was lost is left out of the next restart, which resumes from the last backup on the
processes now present. A machine that returns (the same command run on it again) is
announced for the next attempt: the master then stops the job at a save point and
restarts it with that machine too (`Nodes.grows`). The master itself must stay: it holds
the directory and the backup.

The same command runs once on each machine. JAX and PyTorch need only the master's
address (their coordinator, or torchrun's store, runs there). A `TF_CONFIG` names every
task's address, which no machine knows of the others: machine 0's launcher serves a
small directory at the master's address, where each machine's launcher publishes its
address and ports and reads everyone's (`Nodes.exchange`), as torchrun's c10d store does.
"""

import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from keras_dist import network
from keras_dist.errors import KerasDistError

logger = logging.getLogger("keras_dist")

DEFAULT_PORT = 29400
# Seconds a machine waits for the others to join (they start by hand, or by a scheduler).
JOIN_SECONDS = 600.0
# Elastic jobs: seconds the master waits for machines beyond MIN before an attempt starts
# without them (a lost machine never comes; a slow one joins the next restart).
ELASTIC_WAIT_SECONDS = 10.0
# Seconds the master's directory stays after an elastic job's end, for machines waiting to
# join to read it (they ask every 0.2 s).
ELASTIC_ENDED_SECONDS = 1.0


class JobEnded(KerasDistError):
    """The elastic job ended before this machine joined it."""


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
        min_count: the fewest machines an elastic job (`--nnodes MIN:MAX`) runs on; `count`
            is then the most.
    """

    count: int
    rank: int
    master: str
    port: int = DEFAULT_PORT
    attempt: int = 0
    min_count: int | None = None

    @classmethod
    def parse(cls, count: int | str, rank: int, master: str | None) -> "Nodes":
        """From the command line (`count` as N or MIN:MAX), with one-line errors."""
        least, _, most = str(count).partition(":")
        if not (least.isdigit() and (most.isdigit() or not most)):
            raise KerasDistError(f"--nnodes takes N or MIN:MAX, got {count!r}")
        least, count = int(least), int(most or least)
        if least < 1 or count < least:
            given = count if least == count else f"{least}:{count}"
            raise KerasDistError(f"--nnodes must be at least 1 (MIN:MAX with MIN <= MAX), got {given}")
        if not 0 <= rank < count:
            raise KerasDistError(f"--node-rank must be from 0 to {count - 1} with --nnodes {count}, got {rank}")
        if not master:
            raise KerasDistError("--nnodes needs --master-addr HOST[:PORT], the machine of --node-rank 0, "
                                 "as every machine reaches it")
        host, _, port = master.rpartition(":") if master.count(":") == 1 or master.startswith("[") else ("", "", "")
        if host and not port.isdigit():
            raise KerasDistError(f"--master-addr {master!r}: the port must be a number; write HOST:PORT")
        return cls(count, rank, (host or master).strip("[]"), int(port) if host else DEFAULT_PORT,
                   min_count=least if least < count else None)

    @property
    def elastic(self) -> bool:
        return self.min_count is not None

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

    def assemble(self, attempt: int, moves_port: bool = True) -> "Nodes":
        """This machine's place among the machines of an elastic job's attempt (`count` 1:
        alone). With `moves_port` the port (the engine's coordinator: JAX, torchrun's store)
        moves on at each attempt, so that no restart meets the last one's still closing;
        otherwise it stays, as the directory's (TensorFlow's clusters, Horovod: each
        attempt exchanges new addresses there).

        Every machine announces itself at the master's directory; the master closes the
        attempt once all have, or once at least `min_count` have and `ELASTIC_WAIT_SECONDS`
        have passed, and publishes the members, which the others read. A machine that
        finds an attempt closed without it (it returns after a loss, or starts late)
        announces itself for the next one, which the master begins when it sees it
        (`grows`); where the job has ended, this machine ends too.
        """
        started = time.monotonic()
        members, announced = None, set()
        while members is None:
            try:
                members, attempt = self._close(attempt, started) if self.rank == 0 else self._join(attempt, announced)
            except (urllib.error.URLError, OSError):
                pass  # the master's launcher is not up yet, or restarting
            if members is None and time.monotonic() - started > JOIN_SECONDS:
                raise KerasDistError(f"fewer than {self.min_count} machines joined at {self.master_address} within "
                                     f"{JOIN_SECONDS:g} s; start `keras-dist launch --nnodes {self.min_count}:{self.count}"
                                     f" ...` on more machines")
            if members is None:
                time.sleep(0.2)
        print(f"[keras-dist] attempt {attempt}: {len(members)} of {self.count} machines (node ranks "
              f"{', '.join(map(str, members))})", flush=True)
        return dataclasses.replace(self, count=len(members), rank=members.index(self.rank), min_count=None,
                                   port=self.port + 1 + attempt if moves_port else self.port, attempt=attempt)

    def _close(self, attempt: int, started: float) -> tuple[list | None, int]:
        """The master: the members of `attempt`, once it closes it (else None)."""
        joined = sorted(int(r) for r in self._publish(f"elastic-{attempt}", {}))
        waited = time.monotonic() - started
        if len(joined) < self.count and (len(joined) < self.min_count or waited < ELASTIC_WAIT_SECONDS):
            return None, attempt
        self._publish(f"members-{attempt}", joined)
        self._publish("current", attempt)
        return joined, attempt

    def _join(self, attempt: int, announced: set) -> tuple[list | None, int]:
        """Another machine: the members of the attempt it joins, once the master closed it
        with it (else None), and that attempt, which moves on where the job went on without
        this machine."""
        if self._read("ended"):
            raise JobEnded(f"the job at {self.master_address} ended before this machine (node rank {self.rank}) "
                           "could join it")
        current = self._read("current").get("0")
        if current is not None and current >= attempt and current not in announced:
            attempt = current + 1  # lost and back, or late: the job is past the attempts it knows
        self._publish(f"elastic-{attempt}", {})
        announced.add(attempt)
        closed = self._read(f"members-{attempt}").get("0")
        if closed is None or self.rank in closed:
            return closed, attempt
        return None, attempt + 1  # closed without it: the next one

    def grows(self, attempt: int) -> str | None:
        """Why the elastic job's `attempt` stops to restart on more machines (None: it goes on).

        The master sees a machine announced for the next attempt and says so in the
        directory, where the other machines read it.
        """
        try:
            if self.rank == 0:
                # Not the machines of this attempt, which announce themselves there after a failure.
                members = self._read(f"members-{attempt}").get("0", [])
                waiting = sorted(int(r) for r in self._read(f"elastic-{attempt + 1}") if int(r) not in members)
                if waiting:
                    reason = f"node rank {', '.join(map(str, waiting))} waits to join"
                    self._publish(f"grows-{attempt}", reason)
                    return reason
                return None
            return self._read(f"grows-{attempt}").get("0")
        except (urllib.error.URLError, OSError):
            return None  # the master's directory did not answer: asked again

    def end(self) -> None:
        """On the master, as its job ends: machines that wait to join end too."""
        self._publish("ended", True)

    def exchange(self, value: dict) -> list:
        """Publishes `value` for this machine and returns every machine's, in rank order.

        Machine 0 serves the directory until its launcher ends (`directory`).
        """
        deadline = time.monotonic() + JOIN_SECONDS
        while True:
            try:
                found = self._publish(str(self.attempt), value)
                if len(found) == self.count:
                    return [found[str(rank)] for rank in range(self.count)]
            except (urllib.error.URLError, OSError):
                pass  # the master's launcher is not up yet
            if time.monotonic() > deadline:
                raise KerasDistError(f"not every machine joined at {self.master_address} within {JOIN_SECONDS:g} s; run "
                                     f"`keras-dist launch --nnodes {self.count} --node-rank I --master-addr "
                                     f"{self.master_address} ...` on each machine, I from 0 to {self.count - 1}")
            time.sleep(0.2)

    def _publish(self, key: str, value: object) -> dict:
        """Puts this machine's `value` under `key` in machine 0's directory; returns every
        machine's there, by rank (as text)."""
        body = json.dumps(value).encode()
        _DIRECT.open(urllib.request.Request(f"{self._directory}/{key}/{self.rank}", data=body, method="PUT"), timeout=10)
        return self._read(key)

    def _read(self, key: str) -> dict:
        return json.loads(_DIRECT.open(f"{self._directory}/{key}", timeout=10).read())

    @property
    def _directory(self) -> str:
        # Machine 0 by the address it serves on: its own name may resolve to loopback there.
        return f"http://{self.address if self.rank == 0 else self.master}:{self.port}"


# The directory is on the cluster's own network: never through a proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@contextlib.contextmanager
def directory(nodes: Nodes) -> Iterator[None]:
    """On machine 0, while the job runs: the directory `Nodes.exchange` and `Nodes.assemble`
    read, on the master's address only. An elastic job's end stays there a moment, for
    machines waiting to join to read it."""
    server = _serve_directory(nodes)
    try:
        yield
    finally:
        if nodes.elastic:
            with contextlib.suppress(OSError):
                nodes.end()
                time.sleep(ELASTIC_ENDED_SECONDS)
        server.shutdown()


# The directory's bounds on what a request may be: its bodies are a few small JSON values.
MAX_BODY_BYTES = 64 * 1024
# Seconds a client may take over a request before its connection is closed (a stalled or
# hostile client must not hold a thread for ever).
REQUEST_SECONDS = 5.0
# A key and a rank in a path: what `Nodes` publishes ("3", "elastic-2", "current", ...).
_PATH = re.compile(r"/([A-Za-z0-9_-]{1,64})(?:/([0-9]{1,6}))?")


def _serve_directory(nodes: Nodes) -> ThreadingHTTPServer:
    entries = {}
    lock = threading.Lock()

    class Directory(BaseHTTPRequestHandler):
        timeout = REQUEST_SECONDS

        def do_PUT(self):
            match = _PATH.fullmatch(self.path)
            if not match or match[2] is None:
                return self.send_error(404)
            length = self.headers.get("Content-Length", "")
            if not length.isdigit():
                return self.send_error(411)
            if int(length) > MAX_BODY_BYTES:
                return self.send_error(413)
            try:
                body = self.rfile.read(int(length))
            except OSError:  # the client stalled past REQUEST_SECONDS, or left
                self.close_connection = True
                return
            try:
                value = json.loads(body)
            except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
                return self.send_error(400)
            with lock:
                entries.setdefault(match[1], {})[match[2]] = value
            self._reply(b"{}")

        def do_GET(self):
            match = _PATH.fullmatch(self.path)
            if not match or match[2] is not None:
                return self.send_error(404)
            with lock:
                self._reply(json.dumps(entries.get(match[1], {})).encode())

        def __getattr__(self, name):
            # Any other method is refused with 405, not http.server's 501.
            if name.startswith("do_"):
                return lambda: self.send_error(405)
            raise AttributeError(name)

        def send_error(self, code, message=None, explain=None):
            # Every refusal is the client's doing: a 4xx, never http.server's 505.
            super().send_error(code if code < 500 else 400, message, explain)

        def _reply(self, body):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass  # one line per request is noise in the job's output

    class Server(ThreadingHTTPServer):
        def handle_error(self, request, client_address):
            # A client that breaks off must not print socketserver's traceback into the
            # job's output; the directory keeps serving the others.
            logger.debug("keras_dist's directory: a request from %s failed", client_address[0], exc_info=True)

    try:
        server = Server((nodes.address, nodes.port), Directory)
    except OSError as exc:
        raise KerasDistError(f"machine 0 cannot listen at {nodes.address}:{nodes.port} ({exc.strerror}); "
                             "pick another port in --master-addr HOST:PORT") from None
    threading.Thread(target=server.serve_forever, name="keras_dist-directory", daemon=True).start()
    return server

