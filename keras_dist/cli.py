"""The `keras-dist` command: `launch` a script on this machine or several, show `info`, or `build-horovod`."""

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from keras_dist import settings, strategies
from keras_dist.errors import KerasDistError
from keras_dist.launchers import processes


# The module each Keras backend runs on, and the extra that installs it.
_FRAMEWORKS = {"tensorflow": ("tensorflow", "tf"), "jax": ("jax", "jax"), "torch": ("torch", "torch")}


def _installed(module: str) -> bool:
    if module in sys.modules:
        return sys.modules[module] is not None
    return importlib.util.find_spec(module) is not None


def _require_keras_backend() -> str:
    """The Keras backend, once its framework is known to be installed; else a one-line error naming the fix."""
    variables = settings.current().variables
    backend = strategies.keras_backend(variables)
    if backend not in _FRAMEWORKS:
        return backend  # Keras itself says what it accepts
    module, extra = _FRAMEWORKS[backend]
    if not _installed(module):
        chosen = "KERAS_BACKEND" if variables.get("KERAS_BACKEND") else "Keras's default, or ~/.keras/keras.json"
        others = [name for name, (m, _) in _FRAMEWORKS.items() if name != backend and _installed(m)]
        instead = f"set KERAS_BACKEND={others[0]} (installed), or " if others else ""
        raise KerasDistError(f"Keras runs on {backend} ({chosen}), which is not installed: {instead}"
                             f'pip install "keras_dist[{extra}]"')
    return backend


def _require_engine(backend: str) -> None:
    """A one-line error where the keras_dist backend's engine is not installed."""
    if strategies.REGISTRY[backend].keras_backend == "tensorflow" and not _installed("tensorflow"):
        raise KerasDistError(f'--backend {backend} runs on TensorFlow, which is not installed: '
                             f'pip install "keras_dist[tf]"')
    if backend == "horovod" and not _installed("horovod"):
        raise KerasDistError("--backend horovod needs Horovod built against the installed TensorFlow (and PyTorch): "
                             "run keras-dist build-horovod")


def _launch(args):
    if args.num_workers < 1:
        raise KerasDistError(f"-n must be at least 1, got {args.num_workers}")
    if args.ps < 0:
        raise KerasDistError(f"--ps must be 0 or more, got {args.ps}")
    if not os.path.isfile(args.script):
        raise KerasDistError(f"script {args.script!r} not found; give the path of a Python file")
    chosen = settings.current()  # a bad value stops here, in one line
    if chosen.backend:
        strategies.strategy_class(chosen.backend)
    if args.max_restarts < 0:
        raise KerasDistError(f"--max-restarts must be 0 or more, got {args.max_restarts}")
    if args.grace_period < 0:
        raise KerasDistError(f"--grace-period must be 0 or more seconds, got {args.grace_period}")
    # Keras on JAX or PyTorch trains with the backend of that name; on TensorFlow, Horovod is the default.
    keras_backend = _require_keras_backend()
    args.backend = args.backend or (keras_backend if keras_backend in ("jax", "torch") else "horovod")
    _require_engine(args.backend)
    from keras_dist.launchers import EXCHANGING
    from keras_dist.launchers.launch import run_job
    from keras_dist.launchers.nodes import Nodes

    nodes = Nodes.parse(args.nnodes, args.node_rank, args.master_addr) if args.nnodes != "1" else None
    if nodes and nodes.elastic and args.backend == "parameter_server":
        raise KerasDistError(f"--nnodes {args.nnodes} (an elastic job) cannot run parameter servers, whose "
                             "workers come and go by themselves; give a fixed --nnodes")
    argv = [args.script, *args.script_args]
    outcome = run_job(lambda placed: strategies.local_cluster(args.backend, args.num_workers, args.ps, argv, placed),
                      chosen, nodes=nodes, exchanges=strategies.launcher_of(args.backend) in EXCHANGING,
                      max_restarts=args.max_restarts, grace_period=args.grace_period, backup_dir=args.backup_dir)
    if outcome.report:
        print(f"[keras-dist] {outcome.report}", flush=True)
    return outcome.exit_code


def _info(args):
    _require_keras_backend()
    horovod = _probe_horovod()  # in other processes, beside this one's imports
    import keras

    from keras_dist import runtime

    task = runtime.get()  # what a task started here would use
    strategy = strategies.strategy_class(task.backend)
    facts = {"keras_backend": keras.backend.backend(), "keras": keras.__version__, **task.describe(),
             "strategy": f"{strategy.__module__}.{strategy.__qualname__}",
             "local_launcher": strategies.launcher_of(task.backend) or None}
    if keras.backend.backend() == "jax":
        import jax

        facts.update(jax=jax.__version__, devices=[str(d) for d in jax.local_devices()])
    elif keras.backend.backend() == "torch":
        import torch

        facts.update(torch=torch.__version__, devices=["cpu"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())],
                     gloo=torch.distributed.is_gloo_available(), nccl=torch.distributed.is_nccl_available())
    else:
        import tensorflow as tf

        facts.update(tensorflow=tf.__version__, devices=[d.name for d in tf.config.list_logical_devices()])
    facts["horovod"] = horovod()
    if args.topology:
        facts.update(runtime.init().describe())
    print(json.dumps(facts, indent=2))
    return 0


# Horovod's module for each framework it has operations for. Each is loaded in a process of
# its own: ops built against another TensorFlow or PyTorch fail to load (`undefined symbol`).
_HOROVOD_OPS = {"tensorflow": "horovod.tensorflow", "torch": "horovod.torch"}
_HOROVOD_PROBE = """
import json
try:
    import {module} as hvd
    result = {{"ops": "load", "gloo": hvd.gloo_built(), "mpi": hvd.mpi_built(), "nccl": bool(hvd.nccl_built())}}
except Exception as exc:
    result = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps(result))
"""


def _probe_horovod():
    """Starts loading Horovod's ops for each installed framework; the function returned reports, for each,
    whether they load, and where they do not, why and the fix."""
    if not _installed("horovod"):
        return lambda: "not installed: keras-dist build-horovod builds it against the installed TensorFlow (and PyTorch)"
    from importlib import metadata

    env = processes.child_environment()
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    probes = {framework: subprocess.Popen([sys.executable, "-c", _HOROVOD_PROBE.format(module=module)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
              for framework, module in _HOROVOD_OPS.items() if _installed(framework)}

    def report():
        facts = {"version": metadata.version("horovod")}
        for framework, probe in probes.items():
            out = probe.communicate()[0].strip().splitlines()
            result = json.loads(out[-1]) if probe.returncode == 0 and out else f"the import exited {probe.returncode}"
            if not isinstance(result, dict):  # ImportError, undefined symbol, built without this framework
                result = (f"ops do not load: {' '.join(result.split())}; fix: keras-dist build-horovod "
                          f"(rebuilds Horovod against the installed frameworks)")
            facts[framework] = result
        return facts

    return report


def _build_horovod(args):
    """Runs the shipped Horovod recipe with this interpreter; its exit status is the command's."""
    missing = [tool for tool in ("gcc", "g++", "cmake") if shutil.which(tool) is None]
    if missing:
        raise KerasDistError(f"building Horovod needs {', '.join(missing)}, not found on PATH: install "
                             f"{'them' if len(missing) > 1 else 'it'} first (Debian/Ubuntu: apt-get install -y "
                             f"{' '.join(missing)}{'; or pip install cmake' if 'cmake' in missing else ''})")
    if not _installed("tensorflow"):
        raise KerasDistError("Horovod is built against the installed TensorFlow, which is not installed: "
                             'pip install "keras_dist[tf]" (or tf-cpu, tf-gpu) first')
    if not _installed("pip"):
        raise KerasDistError(f"building Horovod uses pip, which this environment lacks: {sys.executable} -m ensurepip")
    recipe = os.path.join(os.path.dirname(os.path.abspath(__file__)), "horovod_build.sh")
    return subprocess.run(["bash", recipe], env=processes.child_environment(PYTHON=sys.executable)).returncode


def parser() -> argparse.ArgumentParser:
    """The command line of `keras-dist`."""
    parser = argparse.ArgumentParser(prog="keras-dist", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    launch = commands.add_parser("launch", help="run a script as processes on this machine, or on several with --nnodes")
    launch.add_argument("--backend", choices=[n for n in strategies.REGISTRY if n != "single"],
                        help="default: jax or torch where Keras runs on JAX or PyTorch, else horovod")
    launch.add_argument("-n", "--num-workers", type=int, default=2, help="training processes on this machine")
    launch.add_argument("--ps", type=int, default=0,
                        help="parameter-server tasks on this machine (parameter_server backend)")
    launch.add_argument("--nnodes", default="1", help="machines in the job; run the same command on each. MIN:MAX: "
                                                      "elastic, each restart goes on with the machines that answer, "
                                                      "at least MIN")
    launch.add_argument("--node-rank", type=int, default=0, help="this machine's index, 0 on the master")
    launch.add_argument("--master-addr", help="HOST[:PORT] of machine 0 as every machine reaches it "
                                              "(default port 29400)")
    launch.add_argument("--max-restarts", type=int, default=0,
                        help="restart the job this many times after a task fails; fit resumes from its backup "
                             "(--backup-dir, or the script's BackupAndRestore)")
    launch.add_argument("--backup-dir", help="back up every fit of the script here (each epoch's end, every "
                                             "KERAS_DIST_BACKUP_SECONDS, default 300, and at SIGTERM) and resume "
                                             "from it; a script's own BackupAndRestore is used instead where it has one")
    launch.add_argument("--grace-period", type=float, default=30.0,
                        help="seconds the tasks get to save and exit after a SIGTERM or SIGUSR1 to the launcher, "
                             "before they are killed (default 30)")
    launch.add_argument("script")
    launch.add_argument("script_args", nargs=argparse.REMAINDER)
    info = commands.add_parser("info", help="what keras_dist detects in this process")
    info.add_argument("--topology", action="store_true", help="also start the backend and report rank and size")
    commands.add_parser("build-horovod", help="build Horovod against the installed TensorFlow (and PyTorch) with "
                                              "keras_dist's patches, cache the wheel, and install it here "
                                              "(needs gcc, g++, cmake; HOROVOD_VERSION, KERAS_DIST_CACHE)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return {"launch": _launch, "info": _info, "build-horovod": _build_horovod}[args.command](args)
    except KerasDistError as exc:
        print(f"keras-dist: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
