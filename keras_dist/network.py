"""The local address and interface that reach the job: one choice for every engine.

Gloo (PyTorch, JAX, Horovod on CPUs) advertises to its peers the address this machine's
host name resolves to. Debian's and Ubuntu's installers map the host name to 127.0.1.1,
so across machines every peer is told to connect to its own loopback: torch's rank 0
then waits forever, JAX and Horovod fail after minutes. Where the user has chosen no
interface, keras_dist picks the one this machine sends from to reach the job's
coordinator, before any engine starts (`interface_variables`, asked at `import
keras_dist`), and tells each engine: `GLOO_SOCKET_IFNAME` (torch), `HOROVOD_GLOO_IFACE`
(Horovod), `NCCL_SOCKET_IFNAME` (NCCL), and the address itself to JAX, which has no
variable for it (`keras_dist.strategies.jax_data_parallel._gloo_advertises`). The same address is
where a multi-machine job's TensorFlow servers listen (`keras_dist.strategies.tf_server`).
"""

import ipaddress
import logging
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping

logger = logging.getLogger("keras_dist")

# Variables with which a user (or a launcher) has already chosen the interface.
INTERFACE_VARIABLES = ("GLOO_SOCKET_IFNAME", "HOROVOD_GLOO_IFACE", "NCCL_SOCKET_IFNAME")
# TEST-NET-1 (RFC 5737): never routed anywhere, so a route to it is the default route.
_ANY_REMOTE = "192.0.2.1"
_SIOCGIFADDR = 0x8915


def reaching_address(host: str) -> str | None:
    """The IPv4 address this machine sends from to reach `host` (None: unresolvable or no route).

    A UDP socket's `connect` only looks the route up; no packet is sent.
    """
    try:
        target = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_DGRAM)[0][4][0]
    except (socket.gaierror, IndexError):
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((target, 9))
        except OSError:
            return None
        return probe.getsockname()[0]


def names_loopback(host: str) -> bool:
    """Whether `host` is written as this machine's loopback (`localhost`, 127.x): a one-machine job."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def answers(address: str, timeout: float = 2.0) -> bool:
    """Whether something accepts TCP connections at `address` ("host:port", "[v6]:port").

    A frozen process still answers (the kernel accepts for it); a dead one, a machine
    that is off or cut off, does not.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def refuses(address: str, timeout: float = 2.0, within: float = 0.0) -> bool:
    """Whether the machine at `address` refuses TCP connections to its port: the process
    that listened there ended. No answer at all (a frozen or cut-off machine) is not a refusal.
    `within` seconds asks again until then, every 10 ms: a process that is ending may close
    its other connections before its listener, and a peer sees those first (and may itself be
    ended by its engine within about 100 ms: JAX's client aborts once its coordinator is gone)."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + within
    while True:
        try:
            socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
        except ConnectionRefusedError:
            return True
        except (OSError, ValueError):
            return False
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)


def serves(address: str, timeout: float = 2.0) -> bool:
    """Whether a gRPC server at `address` answers within `timeout` seconds.

    Unlike `answers`, this tells a frozen process (stopped, or on a frozen machine)
    from a live one: the kernel accepts a connection for either, but only a running
    server replies to HTTP/2's connection preface (with its SETTINGS frame), even
    while it is busy computing.
    """
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as connection:
            connection.settimeout(timeout)
            connection.sendall(_HTTP2_PREFACE)
            return bool(connection.recv(9))
    except (OSError, ValueError):
        return False


# The client's connection preface and an empty SETTINGS frame (RFC 9113, section 3.4).
_HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def job_address(coordinator_host: str) -> str | None:
    """The address this process's peers reach it by, in a job whose coordinator is `coordinator_host`.

    The route to the coordinator, except where the coordinator's name resolves to this
    machine's loopback although it is a name other machines use (the coordinator's own
    machine, under Debian's 127.0.1.1): then the default route's. None where neither
    exists (with a warning that names the variable to set).
    """
    address = reaching_address(coordinator_host)
    if address is not None and ipaddress.ip_address(address).is_loopback and not names_loopback(coordinator_host):
        address = reaching_address(_ANY_REMOTE)
        if address is None:
            logger.warning("%s names this machine's loopback and there is no default route, so keras_dist cannot "
                           "tell which interface other machines reach; set GLOO_SOCKET_IFNAME", coordinator_host)
    return address


def interface_of(address: str) -> str | None:
    """The name of the interface that holds the IPv4 `address` (None: none does)."""
    return next((name for _, name in socket.if_nameindex() if _address_of(name) == address), None)


def interface_variables(variables: Mapping[str, str], coordinator: str | None) -> tuple[str | None, dict[str, str]]:
    """The engines' interface variables for the interface that reaches `coordinator` (`host:port`).

    None where the user chose an interface already (any of `INTERFACE_VARIABLES` in
    `variables`, the process's environment) or no coordinator is known.

    Returns:
        `(address, variables to set)`: the chosen address, or the address of the interface
        the user named (None where nothing is known), and the variables.
    """
    chosen = next((variables[v].lstrip("=") for v in INTERFACE_VARIABLES if variables.get(v)), None)
    if chosen is not None:
        return _address_of(chosen.split(",")[0]), {}
    if coordinator is None:
        return None, {}
    address = job_address(coordinator.rsplit(":", 1)[0].strip("[]"))
    interface = interface_of(address) if address else None
    if interface is None:
        return None, {}
    logger.debug("job traffic on %s (%s), which reaches %s", interface, address, coordinator)
    # NCCL matches prefixes unless told otherwise.
    return address, {"GLOO_SOCKET_IFNAME": interface, "HOROVOD_GLOO_IFACE": interface, "NCCL_SOCKET_IFNAME": f"={interface}"}


def _address_of(interface: str) -> str | None:
    """The IPv4 address of `interface` (None: it has none, does not exist, or this OS has no
    `fcntl`, as on Windows, where keras_dist must import all the same)."""
    try:
        import fcntl
    except ImportError:
        logger.warning("keras_dist: this OS cannot read the address of interface %s (no fcntl); "
                       "the job's address is left to each engine", interface)
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", interface[:15].encode()))
        except OSError:
            return None
    return socket.inet_ntoa(request[20:24])


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


def listening_in_this_process(port):
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
