"""Several machines on one machine: simulated hosts for multi-host tests and benchmarks.

Each host is a Linux network namespace with its own address on a bridge that lives in a
namespace of its own (so no traffic reaches this machine's interfaces), its own host name
(a UTS namespace per process), its own `/etc/hosts` (`ip netns exec` mounts
`/etc/netns/NAME/hosts` over it), a second interface whose address must never show a
listener, and optionally its own `/tmp` (a mount namespace: no shared disk), a rate limit
on its link, a CPU core, an `sshd` (`ssh=True`: root logs in from any host to any host by
key, for `horovodrun -H`), and a SLURM cluster (`slurm=True`: `slurmctld` on the first
host, a `slurmd` on each, one partition of all hosts, for `srun` and `sbatch`). The
packages they need (openssh-server; slurm-wlm, munge) are installed with apt-get on
first use.
`loopback_names=True` writes each host's own name as 127.0.1.1, as Debian's and Ubuntu's
installers do.

Needs root and iproute2 (`ip`, `tc`), as CI and development machines here have.
`bench/` imports it too (`sys.path` gets `tests/`).

    with HostBed(2) as bed:
        a, b = bed.hosts
        process = bed.start(a, ["python", "-c", "import socket; print(socket.gethostname())"])
        process.wait()
        print(bed.output(process))
"""

import itertools
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

# Namespace names: kdbed<pid>x<n>-<host index>, "br" for the bridge.
_PREFIX = "kdbed"
_beds = itertools.count()


class HostBedError(RuntimeError):
    """The test bed cannot be made here (not root, no iproute2, no namespaces)."""


@dataclass
class Host:
    """One simulated machine."""

    name: str  # its host name
    namespace: str  # its network namespace
    address: str  # on the bridge: how the other hosts reach it
    extra_address: str  # on a second interface, which the job must not listen on
    link: str  # the bridge side of its link (rate limits, cuts)
    tmp: Path | None  # what it sees as /tmp, when it has its own
    core: int | None  # the CPU it runs on, when pinned


class HostBed:
    """N simulated hosts, created on entry and torn down (every process killed) on exit.

    Args:
        count: the number of hosts.
        loopback_names: each host resolves its own name to 127.0.1.1 (Debian's default).
        own_tmp: each host gets a /tmp of its own (no shared disk).
        rate: a `tc tbf` rate for every link (e.g. "200mbit"); None: unlimited.
        pin: run each host's processes on one core (host i on core i mod the cores).
        ssh: run an `sshd` on each host, and let `ssh` on each reach every host as root.
        slurm: run a SLURM cluster of the hosts, one CPU each.
    """

    def __init__(self, count: int, loopback_names: bool = False, own_tmp: bool = False, rate: str | None = None,
                 pin: bool = False, ssh: bool = False, slurm: bool = False):
        self.count, self.loopback_names, self.own_tmp, self.rate, self.pin = count, loopback_names, own_tmp, rate, pin
        self.ssh, self.slurm = ssh, slurm
        self.tag = f"{_PREFIX}{os.getpid()}x{next(_beds)}"
        self.bridge = f"{self.tag}-br"
        # SLURM's state and munge's socket: outside /tmp, which a host may have of its own.
        self.run_dir = Path("/run") / self.tag
        self.hosts: list[Host] = []
        self.processes: list[subprocess.Popen] = []
        self.root = Path(tempfile.mkdtemp(prefix=f"{self.tag}-"))
        # This checkout and the Python running it, where they lie under /tmp (a fresh clone).
        self.keep = sorted({p for p in (Path(__file__).resolve().parent.parent, Path(sys.prefix).resolve())
                            if p.is_relative_to("/tmp")})

    # --- set-up and teardown ----------------------------------------------------
    def __enter__(self) -> "HostBed":
        if os.geteuid() != 0:
            raise HostBedError("the multi-host test bed needs root (network namespaces); run the tests as root")
        if not shutil.which("ip") or not shutil.which("tc"):
            raise HostBedError("the multi-host test bed needs iproute2 (ip, tc); apt-get install -y iproute2")
        remove_stale_beds()
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _create(self) -> None:
        _ip("netns", "add", self.bridge)
        _ip("-n", self.bridge, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge, "link", "set", "br0", "up")
        cores = os.cpu_count() or 1
        for i in range(self.count):
            namespace = f"{self.tag}-{i}"
            host = Host(name=f"node{i}", namespace=namespace, address=f"10.213.0.{i + 1}",
                        extra_address=f"10.214.{i}.1", link=f"h{i}", tmp=self.root / f"node{i}-tmp" if self.own_tmp else None,
                        core=i % cores if self.pin else None)
            _ip("netns", "add", namespace)
            # The host's end is made in the bridge namespace, then moved, so the root namespace never holds it.
            _ip("-n", self.bridge, "link", "add", "eth0", "type", "veth", "peer", "name", host.link)
            _ip("-n", self.bridge, "link", "set", "eth0", "netns", namespace)
            _ip("-n", self.bridge, "link", "set", host.link, "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{host.address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")
            # A second network (a veth pair inside the host: this kernel has no dummy devices).
            _ip("-n", namespace, "link", "add", "eth1", "type", "veth", "peer", "name", "eth1p")
            _ip("-n", namespace, "addr", "add", f"{host.extra_address}/24", "dev", "eth1")
            _ip("-n", namespace, "link", "set", "eth1", "up")
            _ip("-n", namespace, "link", "set", "eth1p", "up")
            # As on a real machine, the default route leaves through the main interface.
            _ip("-n", namespace, "route", "add", "default", "dev", "eth0")
            if self.rate:
                for ns, device in ((self.bridge, host.link), (namespace, "eth0")):
                    subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", device, "root", "tbf", "rate", self.rate,
                                    "burst", "256kb", "latency", "200ms"], check=True, capture_output=True)
            if host.tmp:
                host.tmp.mkdir(mode=0o1777)
            self.hosts.append(host)
        for host in self.hosts:
            self._write_hosts_file(host)
        if self.ssh:
            self._start_sshd()
        if self.slurm:
            self._start_slurm()

    def _write_hosts_file(self, host: Host) -> None:
        lines = ["127.0.0.1 localhost"]
        for other in self.hosts:
            own = other is host
            lines.append(f"{'127.0.1.1' if own and self.loopback_names else other.address} {other.name}")
        directory = Path("/etc/netns") / host.namespace
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "hosts").write_text("\n".join(lines) + "\n")

    def _start_sshd(self) -> None:
        """An sshd per host, and an ssh client that logs in anywhere by key; both read
        /etc/ssh, which `ip netns exec` replaces by /etc/netns/NAME/ssh on each host."""
        install_debian_package("openssh-server", "/usr/sbin/sshd")
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory
        keys = self.root / "keys"
        keys.mkdir()
        for name in ("host_key", "id_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", keys / name], check=True)
        for host in self.hosts:
            etc = Path("/etc/netns") / host.namespace / "ssh"
            etc.mkdir()
            for name in ("host_key", "id_key"):
                shutil.copy(keys / name, etc / name)
            shutil.copy(keys / "id_key.pub", etc / "authorized_keys")
            (etc / "sshd_config").write_text(
                f"ListenAddress {host.address}\nListenAddress 127.0.1.1\nHostKey /etc/ssh/host_key\nAuthorizedKeysFile /etc/ssh/authorized_keys\n"
                "PermitRootLogin prohibit-password\nStrictModes no\nUsePAM no\nPrintMotd no\n")
            (etc / "ssh_config").write_text("Host *\n  IdentityFile /etc/ssh/id_key\n  StrictHostKeyChecking no\n"
                                            "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n")
            self.start(host, ["/usr/sbin/sshd", "-D", "-e"])
        for host in self.hosts:  # until every sshd answers
            for _ in range(100):
                if any(address == host.address and port == 22 for address, port in self.listeners(host)):
                    break
                time.sleep(0.1)
            else:
                raise HostBedError(f"sshd did not start on {host.name}: {self.output(self.processes[-1])[-500:]}")

    def _start_slurm(self) -> None:
        """munged and slurmctld on the first host, slurmd on each; returns once every node is idle.

        Each host reads /etc/netns/NAME/slurm as /etc/slurm. slurmd needs the cgroup
        hierarchies, which `ip netns exec` hides under its own /sys: it mounts them again.
        """
        install_debian_package("slurm-wlm", "/usr/sbin/slurmd")
        install_debian_package("munge", "/usr/sbin/munged")
        socket = self.run_dir / "munge.socket"
        for name in ("ctld", *(f"d-{host.name}" for host in self.hosts)):
            (self.run_dir / name).mkdir(parents=True)
        shutil.chown(self.run_dir, "munge", "munge")
        nodes = "".join(f"NodeName={h.name} NodeAddr={h.address} CPUs=1 State=UNKNOWN\n" for h in self.hosts)
        config = (f"ClusterName={self.tag}\nSlurmctldHost={self.hosts[0].name}({self.hosts[0].address})\n"
                  f"SlurmUser=root\nSlurmdUser=root\nAuthType=auth/munge\nAuthInfo=socket={socket}\n"
                  f"StateSaveLocation={self.run_dir}/ctld\nSlurmdSpoolDir={self.run_dir}/d-%n\n"
                  f"SlurmctldPidFile={self.run_dir}/ctld.pid\nSlurmdPidFile={self.run_dir}/d-%n.pid\n"
                  "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n"
                  "SelectType=select/cons_tres\nSelectTypeParameters=CR_CPU\nMpiDefault=none\n"
                  "SlurmdParameters=config_overrides\nReturnToService=2\n"
                  f"{nodes}PartitionName=bed Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n")
        for host in self.hosts:
            etc = Path("/etc/netns") / host.namespace / "slurm"
            etc.mkdir()
            (etc / "slurm.conf").write_text(config)
            (etc / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupAutomount=no\n")
        first = self.hosts[0]
        self.start(first, ["runuser", "-u", "munge", "--", "/usr/sbin/munged", "-F", f"--socket={socket}",
                           f"--pid-file={self.run_dir}/munged.pid"])
        self.start(first, ["/usr/sbin/slurmctld", "-D", "-i"])
        cgroups = "mount -t tmpfs none /sys/fs/cgroup && for c in freezer cpuset memory devices; do " \
                  "mkdir /sys/fs/cgroup/$c && mount -t cgroup -o $c cgroup /sys/fs/cgroup/$c || exit 3; done"
        for host in self.hosts:
            self.start(host, ["sh", "-c", f"{cgroups} && exec /usr/sbin/slurmd -D -N {host.name}"])
        for _ in range(150):
            states = self.run(first, ["sinfo", "-h", "-o", "%t"], timeout=30).stdout.split()
            if states == ["idle"]:
                return
            time.sleep(0.2)
        logs = "\n".join(self.output(p)[-300:] for p in self.processes[-len(self.hosts) - 2:])
        raise HostBedError(f"the SLURM cluster did not come up (sinfo: {states}):\n{logs}")

    def close(self) -> None:
        """Kills every process of every host, then removes the namespaces and files."""
        for host in self.hosts:
            self.kill(host)
        for process in self.processes:
            if process.poll() is None:
                _kill_group(process.pid, signal.SIGKILL)
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for host in self.hosts:
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / host.namespace, ignore_errors=True)
        subprocess.run(["ip", "netns", "del", self.bridge], capture_output=True)
        shutil.rmtree(self.root, ignore_errors=True)
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.hosts = []

    # --- running processes ------------------------------------------------------
    def command(self, host: Host, argv: list) -> list[str]:
        """`argv` as a command that runs on `host`: its network, name, /etc/hosts, /tmp and core."""
        setup = 'hostname "$0"'
        if host.tmp:
            # Paths under /tmp every host needs (a checkout and its venv there) stay visible.
            for path in self.keep:
                inside = host.tmp / path.relative_to("/tmp")
                setup += f" && mkdir -p {shlex.quote(str(inside))} && mount --bind {shlex.quote(str(path))} {shlex.quote(str(inside))}"
            setup += ' && mount --rbind "$1" /tmp'
        wrapped = ["ip", "netns", "exec", host.namespace, "unshare", "--uts", "--mount", "--propagation", "private",
                   "sh", "-c", setup + ' && shift && exec "$@"', host.name, str(host.tmp or "-")]
        if host.core is not None:
            wrapped += ["taskset", "-c", str(host.core)]
        return wrapped + [str(a) for a in argv]

    def start(self, host: Host, argv: list, env: dict | None = None, cwd=None) -> subprocess.Popen:
        """Starts `argv` on `host` in a session of its own; its output goes to `self.log(process)`.

        A file, not a pipe: nobody reads while the job runs, and a full pipe would stall it.
        """
        log = open(self.root / f"{host.name}-{len(self.processes)}.log", "w")
        process = subprocess.Popen(self.command(host, argv), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        process.log_path = log.name
        log.close()
        self.processes.append(process)
        return process

    @staticmethod
    def output(process: subprocess.Popen) -> str:
        """What a process `start` started has written so far."""
        with open(process.log_path, errors="replace") as f:
            return f.read()

    def run(self, host: Host, argv: list, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
        """Runs a short command on `host` and waits for it."""
        return subprocess.run(self.command(host, argv), env=env, capture_output=True, text=True, timeout=timeout)

    def pids(self, host: Host) -> list[int]:
        """Every process running on `host` (in its network namespace)."""
        listed = subprocess.run(["ip", "netns", "pids", host.namespace], capture_output=True, text=True).stdout
        return [int(p) for p in listed.split()]

    def signal(self, host: Host, signum: int) -> None:
        """Sends `signum` to every process on `host`."""
        for pid in self.pids(host):
            try:
                os.kill(pid, signum)
            except ProcessLookupError:
                pass

    def kill(self, host: Host) -> None:
        """The host is lost: every process on it dies at once."""
        self.signal(host, signal.SIGKILL)

    def cut(self, host: Host) -> None:
        """Unplugs the host's cable: its link goes down, its processes keep running."""
        _ip("-n", self.bridge, "link", "set", host.link, "down")

    def listeners(self, host: Host) -> list[tuple[str, int]]:
        """(address, port) of every TCP socket listening on `host`."""
        out = subprocess.run(["ip", "netns", "exec", host.namespace, "ss", "-Hltn"], capture_output=True,
                             text=True, check=True).stdout
        found = []
        for line in out.splitlines():
            local = line.split()[3]
            address, _, port = local.rpartition(":")
            found.append((address.strip("[]"), int(port)))
        return found


def install_debian_package(package: str, program: str) -> None:
    """Installs a Debian package the bed needs, on first use (as root, with apt-get)."""
    if Path(program).exists():
        return
    environment = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for update in (False, True):  # the package lists may be missing or stale: update once
        if update:
            subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "update", "-q"], env=environment,
                           capture_output=True)
        # Another test process may be installing too (openmpi-bin: tests/test_platforms.py and
        # tests/test_hosts.py run side by side): wait for its lock rather than fail.
        done = subprocess.run(["apt-get", "-o", "DPkg::Lock::Timeout=300", "install", "-y", "-q", package],
                              env=environment, capture_output=True, text=True)
        if done.returncode == 0:
            break
    if done.returncode or not Path(program).exists():
        raise HostBedError(f"the test bed needs {package} and apt-get could not install it: {done.stderr[-300:]}")


def remove_stale_beds() -> None:
    """Removes the namespaces of beds whose test process died without tearing them down."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split("\n")
    for namespace in (line.split()[0] for line in listed if line.startswith(_PREFIX)):
        owner = int(namespace[len(_PREFIX):].split("x")[0])
        if owner == os.getpid() or _alive(owner):
            continue
        for pid in subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
        shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        shutil.rmtree(Path("/run") / namespace.rsplit("-", 1)[0], ignore_errors=True)  # the bed's run_dir


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _kill_group(pid: int, signum: int) -> None:
    try:
        os.killpg(pid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _ip(*args: str) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True)
    if result.returncode:
        raise HostBedError(f"'ip {' '.join(args)}' failed: {result.stderr.strip()}")
