"""The process that runs its TF_CONFIG task's TensorFlow gRPC server (multi-worker and
parameter-server backends): what it must be told before TensorFlow starts.

A backend's `process_variables` asks `server_variables`, which

1. checks that the task's port is free (or already served by this process, when the
   script started its strategy first), so a clash is a one-line error instead of
   TensorFlow's "Could not start gRPC server";
2. keeps the process's TCP listeners on the cluster's address instead of all interfaces
   (`keras_dist.launchers.binding`): its loopback address when every TF_CONFIG address is
   on this machine (127.x or localhost), else the address of this machine that the other
   tasks reach (`_cluster_address`). Unless the library that rewrites wildcard binds is
   loaded already, the variables include it, and the backend's `prepare_process` then
   restarts the process with them (`binding.restart_with_binding`): code that runs before
   `import keras_dist` runs twice, and child processes inherit the setting. Where the
   library is not installed (not Linux, or no C compiler at install), one line says so
   and the server listens on all interfaces;
3. on a machine of one core (a 1-vCPU VM, a process pinned to one core), gives
   TensorFlow's inter-op pool 2 threads instead of the 1 it would size: with one, a
   parameter-server worker's step waited forever on its own reads from the ps tasks (seen
   on simulated hosts pinned to one core each). `TF_NUM_INTEROP_THREADS` set by the user
   wins.

Set KERAS_DIST_BIND_ALL=1 to keep TensorFlow's listeners on all interfaces (for instance
to reach a local cluster from another machine); the port check still runs.
"""

import errno
import ipaddress
import json
import os
import socket
from collections.abc import Mapping

from keras_dist import network
from keras_dist.environments import parse_tf_config
from keras_dist.errors import KerasDistError
from keras_dist.launchers import binding
from keras_dist.settings import Settings


def server_variables(variables: Mapping[str, str], chosen: Settings) -> dict[str, str]:
    """The variables a process that will run its TF_CONFIG task's server needs before
    TensorFlow starts (see the module docstring); checks its port on the way.

    Args:
        variables: the process's variables (`Settings.variables`); TF_CONFIG must be set.
        chosen: keras_dist's settings (`KERAS_DIST_BIND_ALL`).

    Raises:
        KerasDistError: the port is taken, or the process cannot restart (an interactive
            Python).

    Example:

    ```python
    @classmethod
    def process_variables(cls, environment, chosen):
        return server_variables(chosen.variables, chosen)
    ```
    """
    changes = {}
    cluster, kind, index = parse_tf_config(variables["TF_CONFIG"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # Linux only
    if (cores or 1) < 2 and "TF_NUM_INTEROP_THREADS" not in variables:
        changes["TF_NUM_INTEROP_THREADS"] = "2"
    address = cluster[kind][index]
    host, port = _split_address(address)
    if port is None:
        raise KerasDistError(f"TF_CONFIG gives {kind}:{index} the address {address!r}, which has no port; write it as host:port")
    hosts = [_split_address(a)[0] for tasks in cluster.values() for a in tasks]
    if chosen.bind_all:
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
        changes["TF_CONFIG"] = json.dumps({**json.loads(variables["TF_CONFIG"]), "cluster": cluster})
    if bind:
        changes.update(binding.variables_to_bind(variables, bind))
    return changes


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
            if exc.errno == errno.EADDRINUSE and network.listening_in_this_process(port):
                return  # TensorFlow already serves this task here: the script started it first
            if exc.errno == errno.EADDRINUSE:
                raise KerasDistError(f"{what}, which another process is using; free the port or pick another") from None
            raise KerasDistError(f"{what}, on which this process cannot listen ({exc.strerror}); pick another port") from None


