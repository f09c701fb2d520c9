"""Every setting keras_dist reads, and every framework variable it reads or sets, in one place.

`Settings.from_environ(mapping)` reads keras_dist's own settings (`KERAS_DIST_*`) from a
mapping once, checking each value, so that a bad value stops the job in one line naming the
variable. `current()` is this process's, read from its environment when first asked for;
tests build their own from a mapping.

`VARIABLES` declares each variable with its type, default and one line of documentation;
docs/settings.md is checked against it. Who-am-I variables (the launchers' ranks and
addresses) are read by `keras_dist.environments`, and the launchers write their tasks'
environments. Nothing else touches the process environment: `Settings.variables` is a
read-only view of it, which the runtime hands the strategies with the settings, and the
variables keras_dist sets in it before the frameworks start go through `export`
(tests/test_house.py checks both).
"""

import dataclasses
import functools
import os
import types
from collections.abc import Callable, Mapping
from typing import Any

from keras_dist.errors import KerasDistError


@dataclasses.dataclass(frozen=True)
class Variable:
    """One environment variable: who sets it, what it holds, what it does.

    `role`: "setting" (the user sets it), "launcher" (keras_dist's launcher sets it for its
    tasks) or "framework" (a variable of TensorFlow, Horovod, Gloo, NCCL, XLA or OpenMP that
    keras_dist sets where the user did not, or reads).
    """

    name: str
    role: str
    type: str
    default: str
    doc: str


VARIABLES = (
    # keras_dist's settings.
    Variable("KERAS_DIST_BACKEND", "setting", "backend name", "detected from the launcher",
             "the backend (strategy) to run; `keras_dist.init(backend=...)` wins over it"),
    Variable("KERAS_DIST_STEP_TIMEOUT", "setting", "seconds", "120 to join and for the first steps, then 30",
             "how long a process waits for the others before the job stops with a one-line error; each backend "
             "applies it as the table above says"),
    Variable("KERAS_DIST_BUCKET_BYTES", "setting", "bytes", "the backend's",
             "bytes of gradients per collective; 0: one collective per gradient tensor"),
    Variable("KERAS_DIST_BACKUP_DIR", "setting", "directory", "none",
             "back up every fit here and resume from it (what `keras-dist launch --backup-dir` sets)"),
    Variable("KERAS_DIST_BACKUP_SECONDS", "setting", "seconds", "300",
             "seconds between automatic backups inside an epoch, besides each epoch's end and a preemption notice"),
    Variable("KERAS_DIST_SLURM_REQUEUE", "setting", "0 or 1", "1",
             "0: after a SIGUSR1 in a SLURM job, save and stop without `scontrol requeue`"),
    Variable("KERAS_DIST_LOG", "setting", "debug or empty", "empty",
             "debug: every process logs, and `keras-dist launch` keeps the framework start-up lines it drops"),
    Variable("KERAS_DIST_TPU", "setting", "TPU name or address", "TPU_NAME, else the TPU VM's own",
             "the TPU the `tpu` backend connects to; `keras_dist.init(tpu=...)` wins over it"),
    Variable("KERAS_DIST_SHARD", "setting", "optimizer or weights", "none (every process holds the whole state)",
             "shard the optimizer's state (and on JAX the weights) of every model `keras_dist.compile` compiles "
             "without `shard=`: docs/sharding.md"),
    Variable("KERAS_DIST_MIN_SHARD_BYTES", "setting", "bytes", "none (no sharding)",
             "parameter servers: split variables of at least this many bytes across the ps tasks"),
    Variable("KERAS_DIST_BIND_ALL", "setting", "0 or 1", "0",
             "1: local TensorFlow and JAX servers listen on all interfaces instead of loopback"),
    Variable("KERAS_DIST_COORDINATOR_PORT", "setting", "port",
             "srun: 10000 + job id % 20000; mpirun: from its job id; a TPU slice: 8482",
             "under srun, Open MPI's mpirun or on a TPU slice: the port of the job's coordinator"),
    Variable("KERAS_DIST_CACHE", "setting", "directory", "~/.cache/keras_dist",
             "where `keras-dist build-horovod` keeps the Horovod wheels it built"),
    Variable("KERAS_DIST_JOB_SECRET", "setting", "text", "none",
             "the job's secret, the same on every machine: `keras-dist launch --nnodes` signs and checks every request "
             "to the master's directory with it (see security.md)"),
    Variable("KERAS_DIST_JOB_SECRET_FILE", "setting", "file", "none",
             "a file holding the job's secret instead, which only its owner may read (chmod 600)"),
    Variable("KERAS_DIST_INSECURE_DIRECTORY", "setting", "0 or 1", "0",
             "1: `keras-dist launch --nnodes` runs without a secret; anyone who reaches the master's port can then "
             "change the job's addresses: unsafe on a shared network"),
    # What keras_dist's launcher tells its tasks.
    Variable("KERAS_DIST_RESTART", "launcher", "count", "0",
             "which restart of the job (`keras-dist launch --max-restarts`) this task belongs to"),
    Variable("KERAS_DIST_ELASTIC", "launcher", "0 or 1", "0",
             "1: the job is elastic (`keras-dist launch --nnodes MIN:MAX`): a restart may run on another number of processes"),
    Variable("KERAS_DIST_LAUNCHER_PID", "launcher", "pid", "none",
             "the launcher's process; a task ends itself once it is gone"),
    Variable("KERAS_DIST_BIND_ADDRESS", "launcher", "IP address", "none",
             "the address the preloaded `_bind_address.so` puts in place of wildcard listens"),
    # Frameworks' variables keras_dist sets where the user did not, or reads.
    Variable("KERAS_BACKEND", "framework", "jax, torch or tensorflow", "Keras's (~/.keras/keras.json)",
             "read to pick the default backend and to check its framework is installed"),
    Variable("TF_CPP_MIN_LOG_LEVEL", "framework", "0-3", "set to 1",
             "TensorFlow's C++ log level: keras_dist turns informational lines off"),
    Variable("TF_NUM_INTRAOP_THREADS", "framework", "count", "set to cores / local processes",
             "TensorFlow's thread pool, per process of a job on one machine"),
    Variable("OMP_NUM_THREADS", "framework", "count", "set to cores / local processes",
             "PyTorch's thread pool, per process of a job on one machine"),
    Variable("XLA_FLAGS", "framework", "flags", "thread flags added",
             "JAX on CPUs: each process of a local job gets its share of the cores"),
    Variable("HOROVOD_GLOO_TIMEOUT_SECONDS", "framework", "seconds", "set from KERAS_DIST_STEP_TIMEOUT",
             "Horovod's collective timeout, keras_dist's step timeout under Horovod"),
    Variable("GLOO_SOCKET_IFNAME", "framework", "interface", "set to the interface that reaches the coordinator",
             "the network interface of Gloo (PyTorch, JAX)"),
    Variable("HOROVOD_GLOO_IFACE", "framework", "interface", "set as GLOO_SOCKET_IFNAME",
             "the network interface of Horovod's Gloo"),
    Variable("NCCL_SOCKET_IFNAME", "framework", "interface", "set as GLOO_SOCKET_IFNAME",
             "the network interface of NCCL"),
    Variable("LD_PRELOAD", "framework", "libraries", "adds _bind_address.so in local TensorFlow clusters",
             "keeps a local cluster's TensorFlow servers on loopback"),
    Variable("CUDA_VISIBLE_DEVICES", "framework", "GPU list", "unchanged",
             "counted: the GPUs the mirrored backend mirrors over, and those JAX and PyTorch processes share"),
    Variable("JAX_PLATFORMS", "framework", "platforms", "unchanged",
             "read: without cuda or gpu in it, JAX processes take no GPUs"),
    Variable("SLURM_JOB_ID", "framework", "id", "none",
             "read to requeue the job after a SIGUSR1 (`scontrol requeue`)"),
    Variable("KERAS_HOME", "framework", "directory", "~/.keras",
             "read: where keras.json names the Keras backend, when KERAS_BACKEND is unset"),
    Variable("TF_CONFIG", "framework", "JSON", "set by `keras-dist launch` for TensorFlow's clusters",
             "a task that names itself by a host name resolving to loopback here gets its address instead"),
    Variable("TF_NUM_INTEROP_THREADS", "framework", "count", "set to 2 on a task of one core",
             "TensorFlow's inter-op pool: with one thread a parameter-server worker waited forever on its reads"),
    Variable("TPU_NAME", "framework", "TPU name or address", "none",
             "read: the TPU the `tpu` backend connects to, and the sign that selects it"),
    Variable("KUBE_GOOGLE_CLOUD_TPU_ENDPOINTS", "framework", "endpoints", "none",
             "read as TPU_NAME, where GKE sets it"),
)

# A variable set to "" is unset, as a shell's `VAR= command` means.
_UNSET = ("", None)


def _number(kind: Callable[[str], Any], minimum: float):
    def parse(name: str, text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise KerasDistError(f"{name}={text!r} is not a number of at least {minimum}; fix it or unset it")
        return value
    return parse


def _flag(name: str, text: str) -> bool:
    if text not in ("0", "1"):
        raise KerasDistError(f"{name}={text!r} must be 0 or 1; fix it or unset it")
    return text == "1"


def _text(name: str, text: str) -> str:
    return text


def _shard_level(name: str, text: str) -> str:
    if text not in ("optimizer", "weights"):
        raise KerasDistError(f"{name}={text!r} must be optimizer or weights; fix it or unset it")
    return text


def _debug(name: str, text: str) -> bool:
    return text.lower() == "debug"


@dataclasses.dataclass(frozen=True)
class Settings:
    """keras_dist's settings as one process reads them (see `VARIABLES` for each one's meaning)."""

    backend: str | None = None
    step_timeout: float | None = None
    bucket_bytes: int | None = None
    backup_dir: str | None = None
    # Five minutes: a hard failure (a host lost, out of memory: no notice) costs at most that
    # much training, while a backup of a large model (seconds to write) costs little of it.
    backup_seconds: float = 300.0
    slurm_requeue: bool = True
    debug_log: bool = False
    tpu: str | None = None
    min_shard_bytes: int | None = None
    shard: str | None = None
    bind_all: bool = False
    # Never in a repr: a settings object may be logged, and the secret must not show.
    job_secret: str | None = dataclasses.field(default=None, repr=False)
    job_secret_file: str | None = None
    insecure_directory: bool = False
    restart: int = 0
    elastic: bool = False
    # The environment the settings were read from, read-only (the process's, live, for
    # `current()`): framework variables (thread pools, GPUs, a TPU's name) are read in it.
    variables: Mapping[str, str] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "Settings":
        """The settings in `environ`; a bad value is a one-line error naming the variable."""
        values = {}
        for field, (name, parse) in _READERS.items():
            text = environ.get(name)
            if text not in _UNSET:
                values[field] = parse(name, text)
        return cls(**values, variables=types.MappingProxyType(environ))

    def directory_secret(self) -> bytes | None:
        """The job's secret (`KERAS_DIST_JOB_SECRET`, or the file `KERAS_DIST_JOB_SECRET_FILE`),
        None where neither is set. Read only where a launcher needs it: a bad file stops that
        launcher, in one line, and not every task that inherits the variable."""
        if self.job_secret_file is None:
            return None if self.job_secret is None else self.job_secret.encode()
        if self.job_secret is not None:
            raise KerasDistError("set KERAS_DIST_JOB_SECRET or KERAS_DIST_JOB_SECRET_FILE, not both")
        path = self.job_secret_file
        try:
            with open(path, "rb") as file:
                # The mode of the file opened, not of one put in its place after a check.
                mode = os.fstat(file.fileno()).st_mode
                if mode & 0o077:
                    raise KerasDistError(f"KERAS_DIST_JOB_SECRET_FILE={path!r} may be read by its group or others "
                                         f"(mode {mode & 0o777:o}); chmod 600 it")
                secret = file.read().strip()
        except OSError as exc:
            raise KerasDistError(f"KERAS_DIST_JOB_SECRET_FILE={path!r} cannot be read ({exc.strerror}); "
                                 "fix it or unset it") from None
        if not secret:
            raise KerasDistError(f"KERAS_DIST_JOB_SECRET_FILE={path!r} is empty; write the job's secret in it")
        return secret


_READERS = {
    "backend": ("KERAS_DIST_BACKEND", _text),
    "step_timeout": ("KERAS_DIST_STEP_TIMEOUT", _number(float, 1e-3)),
    "bucket_bytes": ("KERAS_DIST_BUCKET_BYTES", _number(int, 0)),
    "backup_dir": ("KERAS_DIST_BACKUP_DIR", _text),
    "backup_seconds": ("KERAS_DIST_BACKUP_SECONDS", _number(float, 1e-3)),
    "slurm_requeue": ("KERAS_DIST_SLURM_REQUEUE", _flag),
    "debug_log": ("KERAS_DIST_LOG", _debug),
    "tpu": ("KERAS_DIST_TPU", _text),
    "min_shard_bytes": ("KERAS_DIST_MIN_SHARD_BYTES", _number(int, 1)),
    "shard": ("KERAS_DIST_SHARD", _shard_level),
    "bind_all": ("KERAS_DIST_BIND_ALL", _flag),
    "job_secret": ("KERAS_DIST_JOB_SECRET", _text),
    "job_secret_file": ("KERAS_DIST_JOB_SECRET_FILE", _text),
    "insecure_directory": ("KERAS_DIST_INSECURE_DIRECTORY", _flag),
    "restart": ("KERAS_DIST_RESTART", _number(int, 0)),
    "elastic": ("KERAS_DIST_ELASTIC", _flag),
}


def markdown_table() -> str:
    """`VARIABLES` as the Markdown table of docs/settings.md (checked by a test, so the two agree)."""
    rows = ["| variable | set by | value | default | what it does |", "| --- | --- | --- | --- | --- |"]
    who = {"setting": "you", "launcher": "keras-dist launch", "framework": "a framework's; keras_dist sets or reads it"}
    rows += [f"| `{v.name}` | {who[v.role]} | {v.type} | {v.default} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows) + "\n"


def export(changes: Mapping[str, str]) -> None:
    """Sets `changes` in this process's environment, where the frameworks read them when they
    start (thread pools, interfaces, timeouts): what `import keras_dist` asks of the strategy."""
    os.environ.update(changes)


@functools.cache
def current() -> Settings:
    """This process's settings, read from its environment once."""
    return Settings.from_environ(os.environ)
