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

The directory admits the job's machines only: each signs every request with the job's
secret (`KERAS_DIST_JOB_SECRET`, the same on every machine), over its method, path, body,
time and a nonce used once (`_signature`); the directory answers 403 to any other request,
and signs its replies, so that a machine knows the master answered (docs/security.md).
"""

import collections
import contextlib
import dataclasses
import hashlib
import heapq
import hmac
import json
import logging
import re
import secrets
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from keras_dist import network
from keras_dist.errors import KerasDistError
from keras_dist.settings import Settings

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
        secret: the job's secret (`job_secret`), which signs every request to the
            directory and its replies; None: unsigned (`KERAS_DIST_INSECURE_DIRECTORY=1`).
    """

    count: int
    rank: int
    master: str
    port: int = DEFAULT_PORT
    attempt: int = 0
    min_count: int | None = None
    secret: bytes | None = dataclasses.field(default=None, repr=False, compare=False)

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
        self._request(f"/{key}/{self.rank}", json.dumps(value).encode())
        return self._read(key)

    def _read(self, key: str) -> dict:
        return json.loads(self._request(f"/{key}"))

    def _request(self, path: str, body: bytes | None = None) -> bytes:
        """The directory's answer to a GET of `path` (a PUT of `body`), signed with the job's
        secret where there is one; a refusal, or an answer not signed with it, is a one-line error."""
        method = "GET" if body is None else "PUT"
        headers = {}
        if self.secret is not None:
            stamp, nonce = str(int(time.time())), secrets.token_hex(16)
            headers = {TIME_HEADER: stamp, NONCE_HEADER: nonce,
                       MAC_HEADER: _signature(self.secret, method, path, stamp, nonce, body or b"")}
        request = urllib.request.Request(self._directory + path, data=body, headers=headers, method=method)
        try:
            with _DIRECT.open(request, timeout=10) as reply:
                answer, mac = reply.read(), reply.headers.get(MAC_HEADER)
        except urllib.error.HTTPError as error:
            if error.code != 403:
                raise
            raise KerasDistError(f"the directory at {self.master_address} refused this machine's request: set the "
                                 "same KERAS_DIST_JOB_SECRET (or KERAS_DIST_JOB_SECRET_FILE) on every machine of the "
                                 f"job, and keep their clocks within {WINDOW_SECONDS:g} s") from None
        if self.secret is not None and not _signed(mac, self.secret, "reply", headers[MAC_HEADER], answer):
            raise KerasDistError(f"{self.master_address} answered without the job's secret: another job, or "
                                 "someone else, serves at that port; check --master-addr and KERAS_DIST_JOB_SECRET")
        return answer

    @property
    def _directory(self) -> str:
        # Machine 0 by the address it serves on: its own name may resolve to loopback there.
        return f"http://{self.address if self.rank == 0 else self.master}:{self.port}"


# The directory is on the cluster's own network: never through a proxy.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# A signed request's headers: when it was made (Unix seconds), a random value sent once,
# and the signature of both with the request's method, path and body.
TIME_HEADER, NONCE_HEADER, MAC_HEADER = "X-Keras-Dist-Time", "X-Keras-Dist-Nonce", "X-Keras-Dist-Mac"
# Seconds a request's time may be from the directory's: long enough for machines' clocks
# that NTP keeps, short enough that the nonces seen within it are few to remember.
WINDOW_SECONDS = 60.0
_STAMP = re.compile(r"[0-9]{1,12}")
_NONCE = re.compile(r"[0-9a-f]{32}")


def _signature(secret: bytes, *parts: str | bytes) -> str:
    """HMAC-SHA256 of `parts`, one a line: none but the last (a body) holds a newline, so
    no two requests share a signed text."""
    text = b"\n".join(part.encode() if isinstance(part, str) else part for part in parts)
    return hmac.new(secret, text, hashlib.sha256).hexdigest()


def _signed(mac: str | None, secret: bytes, *parts: str | bytes) -> bool:
    """Whether `mac` (a header's, maybe missing) is the signature of `parts`, compared in
    constant time."""
    return mac is not None and mac.isascii() and hmac.compare_digest(mac, _signature(secret, *parts))


def job_secret(chosen: Settings) -> bytes | None:
    """The secret this machine's launcher signs and checks the directory's requests with.
    Without one the job stops in one line, unless the user opted out
    (`KERAS_DIST_INSECURE_DIRECTORY=1`): then None, said once."""
    secret = chosen.directory_secret()
    if secret is None and not chosen.insecure_directory:
        raise KerasDistError("a job on several machines needs a secret, the same on each, to sign the requests to "
                             "the master's directory: set KERAS_DIST_JOB_SECRET (e.g. to the output of `python -c "
                             "'import secrets; print(secrets.token_hex(32))'`) or KERAS_DIST_JOB_SECRET_FILE "
                             "(a file of mode 600) on every machine")
    if secret is None:
        logger.warning("keras_dist: KERAS_DIST_INSECURE_DIRECTORY=1: the master's directory admits anyone who "
                       "reaches its port, unsafe on a shared network")
    return secret


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


class _DirectoryEntries:
    """What machine 0's directory holds, and which requests it admits."""

    def __init__(self, secret: bytes | None) -> None:
        self.secret = secret
        self.entries: dict[str, dict[str, Any]] = {}
        self.lock = threading.Lock()
        # The nonces of the requests admitted within the window, and (time, nonce) by time, to
        # forget each once its time is out of the window, when no request can bring it again.
        self.nonces: set[str] = set()
        self.by_time: list[tuple[int, str]] = []
        self.refused: collections.Counter = collections.Counter()  # by client address

    def refusal(self, method: str, path: str, headers: Any, body: bytes, address: str) -> str | None:
        """Why a request is not the job's (None: it is): not signed with its secret, made out
        of the window, or a replay of one admitted. Said once per address."""
        if self.secret is None:
            return None
        stamp, nonce = headers.get(TIME_HEADER, ""), headers.get(NONCE_HEADER, "")
        reason = None
        if not (_STAMP.fullmatch(stamp) and _NONCE.fullmatch(nonce)
                and _signed(headers.get(MAC_HEADER), self.secret, method, path, stamp, nonce, body)):
            reason = "without the job's secret"
        elif abs(time.time() - int(stamp)) > WINDOW_SECONDS:
            reason = f"made over {WINDOW_SECONDS:g} s from this machine's time (a replay, or clocks apart)"
        with self.lock:
            while self.by_time and self.by_time[0][0] < time.time() - WINDOW_SECONDS:
                self.nonces.discard(heapq.heappop(self.by_time)[1])
            if reason is None and nonce in self.nonces:
                reason = "replaying one already made"
            if reason is None:
                self.nonces.add(nonce)
                heapq.heappush(self.by_time, (int(stamp), nonce))
                return None
            self.refused[address] += 1
            first, total = self.refused[address] == 1, self.refused.total()
        if first:  # once per address: a stranger's retries must not flood the job's output
            logger.warning("keras_dist: refused a request from %s %s (%d so far); every machine of the job "
                           "needs the same KERAS_DIST_JOB_SECRET", address, reason, total)
        return reason


class _DirectoryRequest(BaseHTTPRequestHandler):
    """One request to the directory: PUT /KEY/RANK a JSON value, GET /KEY all of them."""

    @property
    def timeout(self) -> float:  # read per request: StreamRequestHandler sets it on the connection
        return REQUEST_SECONDS

    @property
    def directory(self) -> _DirectoryEntries:
        return self.server.directory

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
        if self._refused("PUT", body):
            return
        try:
            value = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
            return self.send_error(400)
        with self.directory.lock:
            self.directory.entries.setdefault(match[1], {})[match[2]] = value
        self._reply(b"{}")

    def do_GET(self):
        match = _PATH.fullmatch(self.path)
        if not match or match[2] is not None:
            return self.send_error(404)
        if self._refused("GET", b""):
            return
        with self.directory.lock:
            self._reply(json.dumps(self.directory.entries.get(match[1], {})).encode())

    def _refused(self, method, body):
        """Whether the request is not the job's, answered 403."""
        if self.directory.refusal(method, self.path, self.headers, body, self.client_address[0]) is None:
            return False
        self.send_error(403)
        return True

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
        if self.directory.secret is not None:  # the machine knows the master answered, to this request
            self.send_header(MAC_HEADER, _signature(self.directory.secret, "reply", self.headers[MAC_HEADER], body))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass  # one line per request is noise in the job's output


class _DirectoryServer(ThreadingHTTPServer):
    def __init__(self, address: tuple[str, int], directory: _DirectoryEntries) -> None:
        self.directory = directory
        super().__init__(address, _DirectoryRequest)

    def handle_error(self, request, client_address):
        # A client that breaks off must not print socketserver's traceback into the
        # job's output; the directory keeps serving the others.
        logger.debug("keras_dist's directory: a request from %s failed", client_address[0], exc_info=True)


def _serve_directory(nodes: Nodes) -> ThreadingHTTPServer:
    try:
        server = _DirectoryServer((nodes.address, nodes.port), _DirectoryEntries(nodes.secret))
    except OSError as exc:
        raise KerasDistError(f"machine 0 cannot listen at {nodes.address}:{nodes.port} ({exc.strerror}); "
                             "pick another port in --master-addr HOST:PORT") from None
    threading.Thread(target=server.serve_forever, name="keras_dist-directory", daemon=True).start()
    return server

