"""Throughput of keras_dist against plain Keras and hand-written loops, in steady state.

    .venv/bin/python bench/run.py [--models jpeg_small,jpeg_cnn,input_only,cnn,mlp,emb]
                                  [--configs NAME,...] [--rounds 3] [--window 20] [--windows 2]
    .venv/bin/python bench/run.py --quick ...   # smoke test: 3 s windows, 1 round, 1 window
    .venv/bin/python bench/run.py --hosts ...   # two simulated hosts on a rate-limited link (root):
                                                # bench/hosts.py, which takes the options after --hosts
    .venv/bin/python bench/run.py --python-b ~/.cache/keras_dist/keras-nightly/bin/python ...
                                                # each configuration also under another environment
                                                # (tools/keras_nightly.py makes that one), alternating

Every configuration runs in this one invocation, on this machine, so the ratios compare
like with like; absolute numbers move with machine load, ratios much less.

Measuring (bench/worker.py): inside each process, after one warm-up epoch, whole epochs
accumulate into windows of at least --window seconds; each window gives samples/s and
CPU-seconds per sample (`time.process_time` of the process, all its threads). For several
processes, samples/s add up over processes, and CPU-s/sample is their CPU summed over
their samples summed. Configurations alternate: the outer loop is --rounds rounds, the
inner one every configuration of every model (A B C A B C ...), each launch giving
--windows windows. Reported figures are medians over all windows of a configuration, and
ratios are ratios of those medians. Printed: a progress line per launch, tables at the
end, and as the last line a JSON object with all figures, `ratios` and `failures`.

A configuration that fails or outlives --timeout is reported, left out of later rounds,
and its ratios are null; the others go on. The samples/epoch column is what a training
process is given to train on (its share), summed over processes; for input_only it is
what the processes actually iterated.

The figures issue 10 asks for (about an hour on the 2-core machine):
    .venv/bin/python bench/run.py --models jpeg_small,jpeg_cnn,input_only,cnn \
        --configs cnn/plain_1,cnn/keras_dist_2,cnn/handwritten_2

Models (`--models`):
  cnn, mlp            NumPy arrays; a CNN (32x32x3, batch 64) and an MLP (batch 128)
  emb                 a 12.8 MB embedding table, for parameter servers
  jpeg_small          tf.data, input-bound: TFRecord files of JPEG images (bench/tfdata.py,
                      written once under --data-dir), decode, random crop 56x56 and flip,
                      batch 64, prefetch, feeding one small convolution
  jpeg_cnn            tf.data, compute-bound: the same pipeline feeding the CNN
  input_only          no model: CPU-seconds per epoch of the jpeg pipeline on one worker
  jax_mlp, torch_mlp  the MLP on Keras's JAX or PyTorch backend (bench/backend_worker.py)
  tensorflow_mlp      the same MLP on Keras's TensorFlow backend under horovodrun -np 2:
                      keras_dist_adam_2 and keras_dist_shard_2 only

The scripts build the tf.data pipeline unsharded; keras_dist does the sharding. Only the
hand-written Horovod loop shards itself: rank r reads files[r::size].

Configurations for cnn and mlp (processes x intra-op threads; --threads, default 1):
  plain_1             Keras `model.fit`, 1 process
  keras_dist_1        `keras_dist.compile` + fit, 1 process (single backend)
  handwritten_1       the hand-written Horovod loop in 1 process: what Keras's fit costs
  handwritten_2       hand-written Horovod Keras 3 loop, 2 processes
  keras_dist_2        keras_dist Horovod backend, 2 processes
  handwritten_per_tensor_2  the hand-written loop with one Horovod all-reduce per gradient, as
                      keras_dist_2 sends them
  keras_dist_2_one_bucket   keras_dist_2 with one bucket for all gradients (KERAS_DIST_BUCKET_BYTES),
                      as handwritten_2 sends them
  handwritten_mwms_2  hand-written MultiWorkerMirroredStrategy loop, 2 processes
  keras_dist_mwms_2   keras_dist multi_worker_mirrored backend, 2 processes
  keras_dist_ps_1     keras_dist parameter_server backend: chief + 1 worker + 1 ps
  keras_dist_ps_2     the same with 2 workers (asynchronous steps; the ratio is steps/s)
emb runs plain_1 and, with 2 workers and 2 ps:
  ps_whole_2          the table whole on one ps task
  ps_sharded_2        the table split over both (KERAS_DIST_MIN_SHARD_BYTES=1 MiB)
For parameter servers only the chief reports; their CPU figures are left out (null).
jpeg_small and jpeg_cnn run (fit over the whole dataset each epoch):
  plain_1             plain Keras fit, 1 process x 2 threads (both cores): the figure to beat
  keras_dist_1        the two-line change, 1 process x 2 threads
  keras_dist_2        the two-line change under horovodrun, 2 ranks x 1 thread
  keras_dist_mwms_2   the two-line change under multi_worker_mirrored, 2 workers x 1 thread
  handwritten_2       hand-written Horovod loop, 2 ranks x 1 thread, file-sharded
  handwritten_mwms_2  hand-written MultiWorkerMirroredStrategy loop, 2 workers x 1 thread,
                      file-sharded: the reference for keras_dist_mwms_2
jax_mlp and torch_mlp run, 1 thread per process:
  plain_1             Keras `fit` on that backend, 1 process
  keras_dist_2        the two-line change, 2 processes (keras_dist's jax or torch launcher)
  keras_native_2      Keras's own data parallelism, 2 processes (JAX: DataParallel; PyTorch:
                      the DDP wrap of Keras >= 3.16), each fitting its share
  handwritten_2       that framework's own loop, 2 processes: a jitted JAX step over a mesh
                      of both processes' devices, or a torch.nn model under DDP
  handwritten_1       the same loop in 1 process: what Keras's trainer costs
  keras_dist_adam_2   keras_dist_2 with Adam; keras_dist_shard_2 the same with its state sharded
                      over the processes (shard="optimizer"); jax_mlp and torch_mlp: keras_dist_shard_weights_2,
                      the weights split too (shard="weights")
  keras_dist_hvd_2    torch_mlp only: the two-line change under horovodrun -np 2 (Horovod's
                      torch operations instead of torch.distributed)
  handwritten_hvd_2   torch_mlp only: the torch.nn model with Horovod's DistributedOptimizer
                      under horovodrun -np 2, the reference for keras_dist_hvd_2
input_only runs, 1 thread per process:
  plain_1             one process iterates the whole pipeline
  keras_dist_2        under horovodrun -np 2, each rank iterates
                      `keras_dist.distribute_dataset(pipeline, training=True)`; the figure
                      is the largest rank's CPU-seconds per epoch
Strategy workers get TF_CONFIG on free 127.0.0.1 ports, as `keras-dist launch` gives them.
"""

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before keras_dist imports TensorFlow
from keras_dist.launchers.processes import kill_process_groups  # noqa: E402

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable


class Failed(Exception):
    """A configuration's launch failed or timed out: `reason` in one line, and the output's tail."""

    def __init__(self, reason, output):
        errors = [line.strip() for line in output.splitlines() if "Error" in line or "Exception" in line]
        super().__init__(f"{reason}; last error: {errors[-1][:300]}" if errors else reason)
        self.tail = output[-3000:]


@dataclass
class Config:
    name: str
    mode: str  # the worker's MODE
    processes: int = 1
    launcher: str | None = None  # None (one plain process), "horovod", or a keras_dist backend name
    num_ps: int = 0
    env: dict = field(default_factory=dict)
    threads: int | None = None  # intra-op threads per process; None: --threads
    worker: str = "worker.py"  # backend_worker.py for Keras on JAX or PyTorch
    python: str = PYTHON  # another environment's interpreter: --python-b


def launch(model, config, args):
    """The windows of one launch of `config`, combined over its processes.

    Returns a list of dicts, one per window: samples_per_s (summed over processes),
    cpu_s_per_sample (None when some processes do not report: parameter servers),
    cpu_s_per_epoch_worker (the largest process's CPU-seconds per epoch) and
    samples_per_epoch (summed over processes).
    """
    threads = config.threads or args.threads
    with tempfile.TemporaryDirectory(prefix="keras_dist_bench_") as sync_dir:
        # backend_worker.py takes the network alone (jax_mlp -> mlp): its backend is KERAS_BACKEND.
        network = model.split("_", 1)[1] if config.worker == "backend_worker.py" else model
        argv = [str(HERE / config.worker), config.mode, network, "--window", str(args.window),
                "--windows", str(args.windows), "--sync", sync_dir, "--data", args.data_dir]
        python = config.python
        if config.launcher is None:
            commands = [([python, *argv], {}, False)]
        elif config.launcher == "horovod":
            commands = [([str(Path(python).parent / "horovodrun"), "-np", str(config.processes), "-H",
                          f"localhost:{config.processes}", "--gloo", python, *argv], {}, False)]
        else:
            from keras_dist.strategies import local_cluster

            tasks = local_cluster(config.launcher, config.processes, config.num_ps, argv)
            commands = [([python if a == PYTHON else a for a in t.argv], t.env, t.serves) for t in tasks]
        env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": str(threads),
               "BENCH_THREADS": str(threads), **config.env}
        codes, output = run_together(commands, env, timeout=args.timeout)
    reports = [json.loads(line.split("BENCH ", 1)[1]) for line in output.splitlines() if "BENCH " in line]
    reporting = sum(1 for _, _, serves in commands if not serves) * (config.processes if config.launcher == "horovod" else 1)
    if any(codes) or len(reports) != reporting:
        raise Failed(f"exit codes {codes}, {len(reports)} of {reporting} processes reported", output)
    all_report = not any(serves for _, _, serves in commands)
    windows = []
    for i in range(args.windows):
        parts = [r["windows"][i] for r in reports]
        samples, cpu = sum(p["samples"] for p in parts), sum(p["cpu_s"] for p in parts)
        windows.append({
            "samples_per_s": sum(p["samples"] / p["seconds"] for p in parts),
            "cpu_s_per_sample": cpu / samples if all_report and samples else None,
            "cpu_s_per_epoch_worker": max(p["cpu_s"] / p["epochs"] for p in parts) if all_report else None,
            "samples_per_epoch": sum(p["samples"] / p["epochs"] for p in parts),
        })
    return windows, reports[0]["params"], reports[0].get("keras")


def run_together(commands, env, timeout):
    """Runs `(argv, extra_env, serves)` commands at once; returns the exit codes and joined output.

    Commands that serve (parameter-server workers and ps tasks) run until the others end.
    Raises `Failed` when the others are not done within `timeout` seconds.

    Output goes to files, not pipes: a worker blocked on a full pipe would stall its peers'
    collectives. Every command has its own process group, killed at the end (horovodrun's
    ranks, strategy workers that outlive a failed peer).
    """
    with contextlib.ExitStack() as files:
        outputs = [files.enter_context(tempfile.TemporaryFile("w+")) for _ in commands]
        procs = [subprocess.Popen(argv, env={**env, **extra}, stdout=out, stderr=subprocess.STDOUT, text=True,
                                  start_new_session=True)
                 for (argv, extra, _), out in zip(commands, outputs)]
        deadline = time.monotonic() + timeout
        timed_out = False
        try:
            for proc, (_, _, serves) in zip(procs, commands):
                if not serves:
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            kill_process_groups(procs)
        for out in outputs:
            out.seek(0)
        output = "".join(out.read() for out in outputs)
        if timed_out:
            raise Failed(f"did not finish in {timeout:.0f} s (hang?)", output)
        codes = [proc.returncode for proc, (_, _, serves) in zip(procs, commands) if not serves]
        return codes, output


SHARDED = {"KERAS_DIST_MIN_SHARD_BYTES": str(1 << 20)}
KINDS = {"cnn": "dense", "mlp": "dense", "emb": "emb", "jpeg_small": "tfdata", "jpeg_cnn": "tfdata",
         "input_only": "input", "jax_mlp": "jax", "torch_mlp": "torch",
         "tensorflow_mlp": "tensorflow"}
CONFIGS = {
    "dense": [
        Config("plain_1", "plain"), Config("keras_dist_1", "keras_dist"),
        Config("handwritten_1", "handwritten", 1, "horovod"),
        Config("handwritten_2", "handwritten", 2, "horovod"), Config("keras_dist_2", "keras_dist", 2, "horovod"),
        Config("handwritten_per_tensor_2", "handwritten_per_tensor", 2, "horovod"),
        Config("keras_dist_2_one_bucket", "keras_dist", 2, "horovod", env={"KERAS_DIST_BUCKET_BYTES": str(1 << 30)}),
        Config("handwritten_mwms_2", "handwritten_mwms", 2, "multi_worker_mirrored"),
        Config("keras_dist_mwms_2", "keras_dist", 2, "multi_worker_mirrored"),
        Config("keras_dist_ps_1", "keras_dist", 1, "parameter_server", 1),
        Config("keras_dist_ps_2", "keras_dist", 2, "parameter_server", 1),
    ],
    "emb": [
        Config("plain_1", "plain"), Config("ps_whole_2", "keras_dist", 2, "parameter_server", 2),
        Config("ps_sharded_2", "keras_dist", 2, "parameter_server", 2, SHARDED),
    ],
    "tfdata": [
        Config("plain_1", "plain", threads=2), Config("keras_dist_1", "keras_dist", threads=2),
        Config("keras_dist_2", "keras_dist", 2, "horovod", threads=1),
        Config("keras_dist_mwms_2", "keras_dist", 2, "multi_worker_mirrored", threads=1),
        Config("handwritten_2", "handwritten", 2, "horovod", threads=1),
        Config("handwritten_mwms_2", "handwritten_mwms", 2, "multi_worker_mirrored", threads=1),
    ],
    "input": [
        Config("plain_1", "input_plain", threads=1), Config("keras_dist_2", "input_keras_dist", 2, "horovod", threads=1),
    ],
    **{backend: [
        Config("plain_1", "plain", env={"KERAS_BACKEND": backend}, worker="backend_worker.py"),
        Config("keras_dist_2", "keras_dist", 2, backend, env={"KERAS_BACKEND": backend}, worker="backend_worker.py"),
        Config("handwritten_1", "handwritten", 1, backend, env={"KERAS_BACKEND": backend}, worker="backend_worker.py"),
        Config("handwritten_2", "handwritten", 2, backend, env={"KERAS_BACKEND": backend}, worker="backend_worker.py"),
        Config("keras_native_2", "keras_native", 2, backend, env={"KERAS_BACKEND": backend}, worker="backend_worker.py"),
    ] for backend in ("jax", "torch")},
}
CONFIGS["torch"] += [Config(name, mode, 2, "horovod", env={"KERAS_BACKEND": "torch"}, worker="backend_worker.py")
                     for name, mode in (("keras_dist_hvd_2", "keras_dist"), ("handwritten_hvd_2", "handwritten"))]
# Adam, its state unsharded and sharded over the 2 processes (keras_dist.compile(shard="optimizer"));
# on JAX and PyTorch the weights split too (shard="weights").
SHARD_LEVELS = {"torch": (("keras_dist_adam_2", {}), ("keras_dist_shard_2", {"BENCH_SHARD": "optimizer"}),
                          ("keras_dist_shard_weights_2", {"BENCH_SHARD": "weights"}))}
SHARD_LEVELS["jax"] = SHARD_LEVELS["torch"]
SHARD_LEVELS["tensorflow"] = SHARD_LEVELS["torch"][:2]
CONFIGS["tensorflow"] = []
for backend, levels in SHARD_LEVELS.items():
    CONFIGS[backend] += [Config(name, "keras_dist", 2, "horovod" if backend == "tensorflow" else backend,
                                env={"KERAS_BACKEND": backend, "BENCH_OPTIMIZER": "adam", **shard},
                                worker="backend_worker.py")
                         for name, shard in levels]
SPS, CPU, EPOCH_CPU = "samples_per_s", "cpu_s_per_sample", "cpu_s_per_epoch_worker"
# model kind -> ratios: (name, numerator, denominator, figure, target from issue 10 or None)
RATIOS = {
    "dense": [
        ("keras_dist_1_vs_plain_1", "keras_dist_1", "plain_1", SPS, None),
        ("keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", SPS, ">= 0.97"),
        ("cpu_keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", CPU, "<= 1.03"),
        ("keras_dist_2_vs_plain_1", "keras_dist_2", "plain_1", SPS, None),
        # Keras's own fit loop against the same hand-written step, in one process: the part
        # of keras_dist_2_vs_handwritten_2 that is Keras's, not keras_dist's.
        ("plain_1_vs_handwritten_1", "plain_1", "handwritten_1", SPS, None),
        ("cpu_plain_1_vs_handwritten_1", "plain_1", "handwritten_1", CPU, None),
        ("keras_dist_mwms_2_vs_handwritten_mwms_2", "keras_dist_mwms_2", "handwritten_mwms_2", SPS, None),
        ("keras_dist_mwms_2_vs_keras_dist_horovod_2", "keras_dist_mwms_2", "keras_dist_2", SPS, None),
        ("keras_dist_ps_2_vs_ps_1", "keras_dist_ps_2", "keras_dist_ps_1", SPS, None),
        ("keras_dist_ps_1_vs_plain_1", "keras_dist_ps_1", "plain_1", SPS, None),
    ],
    "emb": [
        ("ps_sharded_2_vs_ps_whole_2", "ps_sharded_2", "ps_whole_2", SPS, None),
        ("ps_whole_2_vs_plain_1", "ps_whole_2", "plain_1", SPS, None),
    ],
    "tfdata": [
        ("keras_dist_2_vs_plain_1", "keras_dist_2", "plain_1", SPS, ">= 0.9"),
        ("keras_dist_mwms_2_vs_plain_1", "keras_dist_mwms_2", "plain_1", SPS, ">= 0.9"),
        ("keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", SPS, ">= 0.97"),
        ("keras_dist_mwms_2_vs_handwritten_2", "keras_dist_mwms_2", "handwritten_2", SPS, ">= 0.97"),
        ("keras_dist_mwms_2_vs_handwritten_mwms_2", "keras_dist_mwms_2", "handwritten_mwms_2", SPS, None),
        ("handwritten_mwms_2_vs_handwritten_2", "handwritten_mwms_2", "handwritten_2", SPS, None),
        ("keras_dist_1_vs_plain_1", "keras_dist_1", "plain_1", SPS, None),
        ("cpu_keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", CPU, "<= 1.03"),
    ],
    "input": [("cpu_per_worker_vs_one_process", "keras_dist_2", "plain_1", EPOCH_CPU, "<= 0.55")],
    **{backend: [
        ("keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", SPS, None),
        ("cpu_keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2", CPU, None),
        ("keras_dist_2_vs_plain_1", "keras_dist_2", "plain_1", SPS, None),
        ("handwritten_2_vs_plain_1", "handwritten_2", "plain_1", SPS, None),
        # Keras's trainer against the framework's own loop in one process: the part of
        # cpu_keras_dist_2_vs_handwritten_2 that is Keras's, not keras_dist's.
        ("cpu_plain_1_vs_handwritten_1", "plain_1", "handwritten_1", CPU, None),
        ("cpu_handwritten_2_vs_handwritten_1", "handwritten_2", "handwritten_1", CPU, None),
        ("cpu_keras_dist_2_vs_plain_1", "keras_dist_2", "plain_1", CPU, None),
        ("keras_dist_2_vs_keras_native_2", "keras_dist_2", "keras_native_2", SPS, None),
        ("cpu_keras_dist_2_vs_keras_native_2", "keras_dist_2", "keras_native_2", CPU, None),
    ] for backend in ("jax", "torch")},
}
SHARD_RATIOS = [
    ("keras_dist_shard_2_vs_keras_dist_adam_2", "keras_dist_shard_2", "keras_dist_adam_2", SPS, None),
    ("cpu_keras_dist_shard_2_vs_keras_dist_adam_2", "keras_dist_shard_2", "keras_dist_adam_2", CPU, None),
]
WEIGHTS_RATIOS = [
    ("keras_dist_shard_weights_2_vs_keras_dist_adam_2", "keras_dist_shard_weights_2", "keras_dist_adam_2", SPS, None),
    ("cpu_keras_dist_shard_weights_2_vs_keras_dist_adam_2", "keras_dist_shard_weights_2", "keras_dist_adam_2", CPU,
     None),
]
RATIOS["torch"] += [
    ("keras_dist_hvd_2_vs_handwritten_hvd_2", "keras_dist_hvd_2", "handwritten_hvd_2", SPS, None),
    ("cpu_keras_dist_hvd_2_vs_handwritten_hvd_2", "keras_dist_hvd_2", "handwritten_hvd_2", CPU, None),
    ("keras_dist_hvd_2_vs_keras_dist_2", "keras_dist_hvd_2", "keras_dist_2", SPS, None),
    *SHARD_RATIOS,
    *WEIGHTS_RATIOS,
]
RATIOS["jax"] += [*SHARD_RATIOS, *WEIGHTS_RATIOS]
RATIOS["tensorflow"] = SHARD_RATIOS


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt(value, scale=1.0, width=10, digits=1):
    return f"{value * scale:{width}.{digits}f}" if value is not None else f"{'-':>{width}s}"


def meets(value, target):
    if value is None or target is None:
        return ""
    sign, bound = target.split()
    return "yes" if (value >= float(bound) if sign == ">=" else value <= float(bound)) else "NO"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="jpeg_small,jpeg_cnn,input_only,cnn,mlp,emb,jax_mlp,torch_mlp")
    parser.add_argument("--configs", help="only these configurations (comma-separated), each NAME (every model's) "
                                          "or MODEL/NAME, e.g. cnn/keras_dist_2,cnn/handwritten_2; a model none "
                                          "of whose configurations is listed runs all of them")
    parser.add_argument("--rounds", type=int, default=3, help="times every configuration is launched, alternating")
    parser.add_argument("--window", type=float, default=20.0, help="seconds a measured window lasts at least")
    parser.add_argument("--windows", type=int, default=2, help="windows per launch")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process (cnn, mlp, emb)")
    parser.add_argument("--timeout", type=float, help="seconds a launch may take (default: from --window, --windows)")
    parser.add_argument("--data-dir", default=None, help="where the TFRecord files are written once and reused "
                                                         "(default ~/.cache/keras_dist/bench/<version>)")
    parser.add_argument("--python-b", help="also run every chosen configuration (as NAME@b) with this interpreter, "
                        "e.g. a venv with another Keras; ratios NAME@b / NAME")
    parser.add_argument("--quick", action="store_true", help="smoke test: --window 3 --rounds 1 --windows 1")
    args = parser.parse_args()
    if args.quick:
        args.window, args.rounds, args.windows = 3.0, 1, 1
    args.timeout = args.timeout or 180 + args.windows * (2 * args.window + 90)
    models = args.models.split(",")
    unknown = [m for m in models if m not in KINDS]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; choose from {', '.join(KINDS)}")
    wanted = set(args.configs.split(",")) if args.configs else set()
    plan = []
    for m in models:
        listed = [c for c in CONFIGS[KINDS[m]] if c.name in wanted or f"{m}/{c.name}" in wanted]
        plan += [(m, c) for c in listed or CONFIGS[KINDS[m]]]
    known = {c.name for cs in CONFIGS.values() for c in cs} | {f"{m}/{c.name}" for m in KINDS for c in CONFIGS[KINDS[m]]}
    if wanted - known:
        parser.error(f"unknown configuration(s) {', '.join(sorted(wanted - known))}")

    if args.python_b:  # alternating with the configurations they mirror
        plan = [pair for m, c in plan for pair in ((m, c), (m, dataclasses.replace(c, name=f"{c.name}@b",
                                                                                 python=args.python_b)))]
    if any(KINDS[m] in ("tfdata", "input") for m in models):
        sys.path.insert(0, str(HERE))
        import tfdata

        args.data_dir = args.data_dir or tfdata.default_directory()
        print(f"TFRecord files: {tfdata.ensure_records(args.data_dir)}", flush=True)
    args.data_dir = args.data_dir or ""

    print(f"{len(plan)} configurations x {args.rounds} rounds, {args.windows} window(s) of >= {args.window:g} s "
          f"per launch, timeout {args.timeout:.0f} s", flush=True)
    windows = {key: [] for key in ((m, c.name) for m, c in plan)}
    params, failures, kerases = {}, {}, {}
    started = time.monotonic()
    for round_ in range(args.rounds):
        for model, config in plan:
            key = (model, config.name)
            if key in failures:
                continue
            t0 = time.monotonic()
            try:
                got, params[model], kerases[key] = launch(model, config, args)
            except Failed as exc:
                failures[key] = str(exc)
                print(f"round {round_ + 1} {model:10s} {config.name:18s} FAILED, skipped from now on: {exc}\n"
                      f"--- output tail ---\n{exc.tail}\n---", flush=True)
                continue
            windows[key].extend(got)
            print(f"round {round_ + 1} {model:10s} {config.name:18s} {fmt(median(w[SPS] for w in got))} samples/s "
                  f"{fmt(median(w[CPU] for w in got), 1000, 8, 3)} CPU-ms/sample "
                  f"{fmt(median(w['samples_per_epoch'] for w in got), 1, 7, 0)} samples/epoch  "
                  f"({time.monotonic() - t0:.0f} s, total {time.monotonic() - started:.0f} s)", flush=True)

    results, ratios, table = {}, {}, []
    for model in models:
        runs = {}
        for config in [c for m, c in plan if m == model]:
            got = windows.get((model, config.name))
            if got is None:
                continue
            runs[config.name] = {figure: median(w[figure] for w in got)
                                 for figure in (SPS, CPU, EPOCH_CPU, "samples_per_epoch")}
            runs[config.name]["windows"] = len(got)
            runs[config.name]["keras"] = kerases.get((model, config.name))
            runs[config.name]["window_samples_per_s"] = [round(w[SPS], 2) for w in got]
        results[model] = {"params": params.get(model), "configurations": runs}
        mirrored = [(f"{c.name}@b_vs_{c.name}{suffix}", f"{c.name}@b", c.name, figure, None)
                    for m, c in plan if m == model and not c.name.endswith("@b")
                    for suffix, figure in (("", SPS), ("_cpu", CPU))]
        for name, numerator, denominator, figure, target in RATIOS[KINDS[model]] + mirrored:
            if numerator not in runs or denominator not in runs:
                continue
            top, bottom = runs[numerator][figure], runs[denominator][figure]
            value = top / bottom if top is not None and bottom else None
            ratios[f"{model}_{name}"] = value
            table.append((model, name, value, target))

    print(f"\n{'model':10s} {'configuration':18s} {'samples/s':>10s} {'CPU-ms/sample':>14s} "
          f"{'worker CPU-s/epoch':>19s} {'samples/epoch':>14s} {'windows':>8s}")
    for model in models:
        for name, run in results[model]["configurations"].items():
            print(f"{model:10s} {name:18s} {fmt(run[SPS])} {fmt(run[CPU], 1000, 14, 3)} "
                  f"{fmt(run[EPOCH_CPU], 1, 19, 3)} {fmt(run['samples_per_epoch'], 1, 14, 0)} {run['windows']:8d}"
                  f"  Keras {run['keras']}")
    print(f"\n{'model':10s} {'ratio':42s} {'value':>7s} {'target':>8s} {'met':>4s}")
    for model, name, value, target in table:
        print(f"{model:10s} {name:42s} {fmt(value, 1, 7, 3)} {target or '':>8s} {meets(value, target):>4s}")
    for (model, name), reason in failures.items():
        print(f"FAILED {model} {name}: {reason}")
    print(f"total {time.monotonic() - started:.0f} s", flush=True)
    print(json.dumps({
        "settings": {k: getattr(args, k) for k in ("rounds", "window", "windows", "threads")},
        "results": results,
        "ratios": {k: None if v is None else round(v, 3) for k, v in ratios.items()},
        "failures": {f"{m}/{c}": reason for (m, c), reason in failures.items()},
    }))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--hosts"]:  # the two-host mode has a script of its own
        os.execv(PYTHON, [PYTHON, str(HERE / "hosts.py"), *sys.argv[2:]])
    main()
