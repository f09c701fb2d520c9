"""TF_CONFIG, the cluster description every `tf.distribute` multi-process backend reads.

Backend-agnostic: the multi-worker and parameter-server backends both parse it here, so
a malformed TF_CONFIG gets the same one-line error whichever backend reads it, and both
prepare the processes that run TensorFlow's gRPC servers here (`prepare_server_process`).
"""

import ctypes
import errno
import ipaddress
import json
import logging
import os
import socket
import sys
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from keras_dist import network, settings
from keras_dist.errors import KerasDistError

logger = logging.getLogger("keras_dist")

_EXAMPLE = '{"cluster": {"worker": ["host1:2222", "host2:2222"]}, "task": {"type": "worker", "index": 0}}'


def detected_cluster(environ: Mapping[str, str]) -> dict | None:
    """TF_CONFIG's cluster, read leniently for backend detection.

    Args:
        environ: the environment to read.

    Returns:
        None without TF_CONFIG; `{}` when it cannot be read (the backend chosen then
        parses it with `parse_tf_config`, which says what is wrong); else the cluster dict.

    Example:

    ```python
    has_ps = bool((detected_cluster(environ) or {}).get("ps"))
    ```
    """
    text = environ.get("TF_CONFIG")
    if not text:
        return None
    try:
        cluster = json.loads(text).get("cluster")
    except (ValueError, AttributeError):
        return {}
    return cluster if isinstance(cluster, dict) else {}


def parse_tf_config(text: str) -> tuple[dict[str, list[str]], str, int]:
    """`(cluster, task_type, task_index)` from a TF_CONFIG string, with one-line errors.

    Args:
        text: the value of the TF_CONFIG environment variable.

    Example:

    ```python
    cluster, kind, index = parse_tf_config(environ["TF_CONFIG"])
    ```
    """
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise KerasDistError(f"TF_CONFIG is not valid JSON ({exc}); set it like {_EXAMPLE}") from None
    if not isinstance(config, dict) or not isinstance(config.get("cluster"), dict):
        raise KerasDistError(f'TF_CONFIG has no "cluster" object; set it like {_EXAMPLE}')
    cluster = config["cluster"]
    task = config.get("task")
    if not isinstance(task, dict) or "type" not in task:
        raise KerasDistError('TF_CONFIG has no "task"; add "task": {"type": "worker", "index": N} for this process')
    kind, index = task["type"], task.get("index", 0)
    if kind not in cluster:
        raise KerasDistError(f"TF_CONFIG task type {kind!r} is not in its cluster ({', '.join(cluster)}); use one of those")
    if not isinstance(index, int) or not 0 <= index < len(cluster[kind]):
        raise KerasDistError(
            f"TF_CONFIG task index {index!r} is out of range: the cluster has {len(cluster[kind])} "
            f"{kind!r} tasks; use an index from 0 to {len(cluster[kind]) - 1}"
        )
    addresses = [a for tasks in cluster.values() for a in tasks]
    duplicates = sorted({a for a in addresses if addresses.count(a) > 1})
    if duplicates:
        raise KerasDistError(f"TF_CONFIG lists {duplicates[0]} more than once; give every task its own host:port")
    return cluster, kind, index


BIND_ALL_ENV = "KERAS_DIST_BIND_ALL"
# Read by the preloaded library (keras_dist/bind_address.c): the address replacing wildcards.
BIND_ADDRESS_ENV = "KERAS_DIST_BIND_ADDRESS"
BIND_LIBRARY = Path(__file__).with_name("_bind_address.so")


def prepare_server_process(environ: MutableMapping[str, str]) -> None:
    """Prepares a process that will run its TF_CONFIG task's TensorFlow gRPC server.

    Call it from a backend's `prepare_process`, before the server starts. It

    1. checks that the task's port is free (or already served by this process, when the
       script started its strategy first), so a clash is a one-line error instead of
       TensorFlow's "Could not start gRPC server";
    2. makes the process's TCP listeners bind to the cluster's address instead of all
       interfaces: its loopback address when every TF_CONFIG address is on this machine
       (127.x or localhost), else the address of this machine that the other tasks reach
       (`_cluster_address`). TensorFlow hard-codes a wildcard listen address, and its
       servers run whatever graph a client sends, without authentication. Unless the library that rewrites
       wildcard binds (`keras_dist/_bind_address.so`, built at install) is loaded already,
       the process restarts itself (same interpreter and command line, `sys.orig_argv`)
       with it in LD_PRELOAD. Code that runs before `import keras_dist` therefore runs
       twice, and child processes inherit the setting;
    3. on a machine of one core (a 1-vCPU VM, a process pinned to one core), gives
       TensorFlow's inter-op pool 2 threads instead of the 1 it would size: with one, a
       parameter-server worker's step waited forever on its own reads from the ps tasks
       (seen on simulated hosts pinned to one core each). `TF_NUM_INTEROP_THREADS` set
       by the user wins.

    Set KERAS_DIST_BIND_ALL=1 to keep TensorFlow's listeners on all interfaces (for
    instance to reach a local cluster from another machine); the port check still runs.

    Args:
        environ: the process environment (`keras_dist.settings.environ()`); TF_CONFIG must be set.

    Raises:
        KerasDistError: the port is taken, or the process cannot restart (an interactive
            Python). Where the library is not installed (not Linux, or no C compiler at
            install), one line says so and the server listens on all interfaces.

    Example:

    ```python
    @classmethod
    def prepare_process(cls, environ):
        prepare_server_process(environ)
        ...  # start the strategy or tf.distribute.Server
    ```
    """
    cluster, kind, index = parse_tf_config(environ["TF_CONFIG"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux only
    if (cores or 1) < 2:
        environ.setdefault("TF_NUM_INTEROP_THREADS", "2")
    address = cluster[kind][index]
    host, port = _split_address(address)
    if port is None:
        raise KerasDistError(f"TF_CONFIG gives {kind}:{index} the address {address!r}, which has no port; write it as host:port")
    hosts = [_split_address(a)[0] for tasks in cluster.values() for a in tasks]
    if settings.current().bind_all:
        bind = None
    elif all(_loopback_ipv4(h) for h in hosts):
        bind = _loopback_ipv4(host)
    else:
        bind = _cluster_address(host, hosts)
    # Where the server will listen: TensorFlow's wildcard (dual-stack when the machine
    # has IPv6), or the address the library puts in its place.
    listen_host = bind or ("::" if socket.has_dualstack_ipv6() else "0.0.0.0")
    _check_port_free(listen_host, port, f"TF_CONFIG gives {kind}:{index} the address {address}")
    if bind and bind != _loopback_ipv4(host) and _resolves_to_loopback(host):
        # This task reaches itself by its own name, which resolves to loopback here (Debian's
        # 127.0.1.1), where nothing listens now: it names itself by its address instead.
        cluster[kind][index] = f"{bind}:{port}"
        environ["TF_CONFIG"] = json.dumps({**json.loads(environ["TF_CONFIG"]), "cluster": cluster})
    if bind:
        _restart_with_binding(environ, bind)


def _split_address(address):
    """`(host, port)` from `host:port` or `[v6]:port`; the port is None when missing."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port) if port.isdigit() else None


def _cluster_address(host, hosts):
    """The address of this machine by which the cluster's other tasks reach `host` (None: unknown).

    `host` resolved here, where that is one of this machine's own addresses; where it
    resolves to loopback (Debian's 127.0.1.1 for the machine's own name), the address
    that routes to another task's host.
    """
    if not _resolves_to_loopback(host):
        try:
            resolved = socket.gethostbyname(host)
        except OSError:
            return None
        return resolved if network.interface_of(resolved) else None  # else not this machine's (NAT): keep TF's
    for other in hosts:
        address = network.reaching_address(other) if other != host else None
        if address and not ipaddress.ip_address(address).is_loopback:
            return address
    return None


def _resolves_to_loopback(host):
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except OSError:
        return False


def _loopback_ipv4(host):
    """The IPv4 loopback address `host` names (localhost: 127.0.0.1), else None."""
    if host == "localhost":
        return "127.0.0.1"
    try:
        loopback = ipaddress.IPv4Address(host)
    except ValueError:
        return None
    return str(loopback) if loopback.is_loopback else None


def _check_port_free(host, port, what):
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As gRPC does: connections of an earlier run still in TIME_WAIT do not block the port.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            # Bound, never listening: closing it frees the port at once.
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE and _listening_in_this_process(port):
                return  # TensorFlow already serves this task here: the script started it first
            if exc.errno == errno.EADDRINUSE:
                raise KerasDistError(f"{what}, which another process is using; free the port or pick another") from None
            raise KerasDistError(f"{what}, on which this process cannot listen ({exc.strerror}); pick another port") from None


def _listening_in_this_process(port):
    """Whether a TCP socket of this process listens on `port` (False where /proc is missing)."""
    sockets = set()
    try:
        listeners = tcp_listeners()
        for fd in os.listdir("/proc/self/fd"):
            try:
                sockets.add(os.readlink(f"/proc/self/fd/{fd}"))  # "socket:[INODE]"
            except OSError:  # closed meanwhile
                pass
    except OSError:
        return False
    return any(p == port and f"socket:[{inode}]" in sockets for _, p, inode in listeners)


def tcp_listeners() -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int, str]]:
    """`(address, port, inode)` for every listening TCP socket, read from /proc/net (Linux).

    Covers every process in this network namespace; `inode` matches the
    `socket:[INODE]` links under `/proc/PID/fd`.

    Returns:
        A list of `(ipaddress.IPv4Address | IPv6Address, int, str)`.

    Example:

    ```python
    exposed = [port for address, port, _ in tcp_listeners() if address.is_unspecified]
    ```
    """
    listeners = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            rows = [line.split() for line in f][1:]
        for row in rows:
            address, port = row[1].split(":")
            if row[3] == "0A":  # LISTEN
                # The kernel prints the address as 32-bit words in host byte order.
                raw = b"".join(int(address[i:i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(address), 8))
                listeners.append((ipaddress.ip_address(raw), int(port, 16), row[9]))
    return listeners


def _active_binding():
    """The address the preloaded library binds to, or None when it is not loaded or inactive."""
    try:
        reader = ctypes.CDLL(None).keras_dist_bind_address
    except AttributeError:
        return None
    reader.restype = ctypes.c_char_p
    value = reader()
    return value.decode() if value else None


def binding_env(environ: Mapping[str, str], address: str) -> dict[str, str]:
    """Variables that make a new process's TCP listeners bind to `address`, not all interfaces.

    `prepare_server_process` restarts a process with them. A launcher that starts a local
    cluster can set them on each task up front, sparing it that restart (and a second
    TensorFlow import). KERAS_DIST_BIND_ALL=1 in the task's environment still wins.

    Args:
        environ: the environment the new process inherits; its LD_PRELOAD entries are kept.
        address: the IPv4 address to listen on, e.g. `"127.0.0.1"`.

    Returns:
        `{"LD_PRELOAD": ..., "KERAS_DIST_BIND_ADDRESS": address}`.

    Where the library is not installed (not Linux, or no C compiler at install), it says
    so in one line, and the process listens on all interfaces.

    Example:

    ```python
    Task("worker:0", argv, env={"TF_CONFIG": config, **binding_env(environ, "127.0.0.1")})
    ```
    """
    if not _binding_library_installed(environ, address):
        return {BIND_ADDRESS_ENV: address}  # tells the task that its launcher said so already
    others = [p for p in _preloaded(environ) if p != str(BIND_LIBRARY)]
    return {"LD_PRELOAD": ":".join([str(BIND_LIBRARY), *others]), BIND_ADDRESS_ENV: address}


_OPT_OUT = f"or set {BIND_ALL_ENV}=1 to let TensorFlow listen on all interfaces"


def _preloaded(environ):
    return [p for p in environ.get("LD_PRELOAD", "").replace(" ", ":").split(":") if p]


def _binding_library_installed(environ, address):
    """Whether the library is there; where it is not, says once, in one line, what that leaves open."""
    global _missing_library_said
    if BIND_LIBRARY.exists():
        return True
    if not _missing_library_said and not settings.current().bind_all and environ.get(BIND_ADDRESS_ENV) != address:
        _missing_library_said = True
        logger.warning("keras_dist: %s is not installed (keras_dist was installed without a C compiler, or not on "
                       "Linux), so this job's TensorFlow servers and torch store listen on all interfaces, not on %s "
                       "only; reinstall keras_dist where gcc is present, or set %s=1 to accept that",
                       BIND_LIBRARY.name, address, BIND_ALL_ENV)
    return False


_missing_library_said = False


def _restart_with_binding(environ, address):
    if _active_binding() == address or not _binding_library_installed(environ, address):
        return
    if environ.get(BIND_ADDRESS_ENV) == address and str(BIND_LIBRARY) in _preloaded(environ):
        # Set up already (by a launcher or our own restart): the dynamic loader refused the library.
        raise KerasDistError(f"{BIND_LIBRARY} is in LD_PRELOAD but was not loaded (see the loader's message above); {_OPT_OUT}")
    if sys.argv[0] in ("", "-") or not sys.executable:
        raise KerasDistError(
            f"an interactive Python cannot restart itself to listen on {address} only; start it with "
            f"LD_PRELOAD={BIND_LIBRARY} {BIND_ADDRESS_ENV}={address}, {_OPT_OUT}"
        )
    env = {**environ, **binding_env(environ, address)}
    # Buffered output is dropped, not flushed: the new process prints it again.
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
