"""Communication-bound training between two simulated hosts on a rate-limited link.

    .venv/bin/python bench/hosts.py [--models cnn,mlp] [--rate 200mbit] [--configs NAME,...]
                                    [--rounds 2] [--window 20] [--windows 2] [--buckets 1,4,64]
                                    [--cycles 0.1,0.25] [--env NAME=VALUE ...] [--link-only]

Needs root (tests/hostbed.py): two network namespaces, one core each, an sshd on each,
and every link limited with `tc tbf` to --rate. Horovod configurations run under
`horovodrun -np 2 -H node0:1,node1:1 --gloo` from the first host, over ssh, with
bench/worker.py measuring windows as bench/run.py does (medians over windows,
configurations alternated round by round, CPU-seconds per sample summed over ranks).

MultiWorkerMirrored, and Keras on PyTorch and JAX (bench/backend_worker.py), run under
`keras-dist launch --backend B --nnodes 2 --node-rank I --master-addr node0` on each host,
as a user runs them.

Configurations (processes x 1 core):
  plain_1                  Keras `fit`, one process on the first host: the compute rate
  keras_dist_2             the two-line change on Horovod (bucketed, overlapped all-reduce)
  keras_dist_2_bN          the same with KERAS_DIST_BUCKET_BYTES = N MiB (--buckets; also torch_keras_dist_2_bN)
  keras_dist_2_cT          the same with HOROVOD_CYCLE_TIME = T ms (--cycles; Horovod's default is 1)
  keras_dist_fp16_2        the same with gradient_compression="fp16"
  keras_dist_mwms_2        the two-line change on MultiWorkerMirrored (`keras-dist launch` on each host;
                           also keras_dist_mwms_2_bN: TensorFlow's CommunicationOptions.bytes_per_pack)
  handwritten_mwms_2       a tf.function step run by MultiWorkerMirroredStrategy, TF_CONFIG as above
  handwritten_2            hand-written Horovod loop, one grouped all-reduce after backward
  handwritten_per_tensor_2 hand-written Horovod loop, one all-reduce per gradient tensor
  torch_plain_1, jax_plain_1          Keras `fit` on that Keras backend, one process
  torch_keras_dist_2, jax_keras_dist_2  the two-line change on that Keras backend
  torch_keras_dist_fp16_2  the same on PyTorch with gradient_compression="fp16"
  torch_ddp_2              DistributedDataParallel (gloo) over a `torch.nn` MLP or the Keras CNN
  jax_sharded_jit_2        a jitted JAX step whose batch is sharded over both processes (the CNN:
                           the Keras network's `stateless_call`)

Reported per model: samples/s (both hosts), CPU-s/sample, scaling efficiency (samples/s
over twice plain_1) and the overlap limit: two hosts whose per-step compute (from
plain_1) fully hides the all-reduce, which moves the gradients' bytes once each way over
the link (ring all-reduce between two hosts), at the link throughput measured first
(one way; also printed: each direction's while both hosts send at once, --link-only).
The last line is a JSON object with every figure.
"""

import argparse
import json
import os
import secrets
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))
from hostbed import HostBed  # noqa: E402

PYTHON = sys.executable
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")
KERAS_DIST = str(Path(PYTHON).parent / "keras-dist")
BATCH = {"cnn": 64, "mlp": 128}  # bench/worker.py's
PORT = 29900


def configs(buckets, cycles=()):
    found = {"plain_1": ("plain", None, {}), "keras_dist_2": ("keras_dist", "horovod", {}),
             "keras_dist_fp16_2": ("keras_dist", "horovod", {"BENCH_COMPRESSION": "fp16"}),
             "handwritten_2": ("handwritten", "horovod", {}),
             "handwritten_per_tensor_2": ("handwritten_per_tensor", "horovod", {}),
             "keras_dist_mwms_2": ("keras_dist", "multi_worker_mirrored", {}),
             "handwritten_mwms_2": ("handwritten_mwms", "multi_worker_mirrored", {})}
    for mib in buckets:
        size = {"KERAS_DIST_BUCKET_BYTES": str(int(mib * 2**20))}
        found[f"keras_dist_2_b{mib:g}"] = ("keras_dist", "horovod", size)
        found[f"keras_dist_mwms_2_b{mib:g}"] = ("keras_dist", "multi_worker_mirrored", size)
    for ms in cycles:
        found[f"keras_dist_2_c{ms:g}"] = ("keras_dist", "horovod", {"HOROVOD_CYCLE_TIME": f"{ms:g}"})
    for backend, reference in (("torch", "ddp"), ("jax", "sharded_jit")):
        env = {"KERAS_BACKEND": backend, "BENCH_THREADS": "1"}
        if backend == "torch":
            for mib in buckets:
                found[f"torch_keras_dist_2_b{mib:g}"] = ("keras_dist", "torch",
                                                         {**env, "KERAS_DIST_BUCKET_BYTES": str(int(mib * 2**20))})
        found.update({f"{backend}_plain_1": ("plain", None, env), f"{backend}_keras_dist_2": ("keras_dist", backend, env),
                      f"{backend}_{reference}_2": ("handwritten", backend, env)})
    found["torch_keras_dist_fp16_2"] = ("keras_dist", "torch", {**found["torch_keras_dist_2"][2], "BENCH_COMPRESSION": "fp16"})
    return found


def family(name):
    """The configurations' Keras backend prefix ("" for TensorFlow): its rows share one plain_1."""
    return next((prefix for prefix in ("torch_", "jax_") if name.startswith(prefix)), "")


def link_bytes_per_s(bed, seconds=4.0):
    """TCP throughput from the first host to the second, measured with a plain socket."""
    receiver = bed.start(bed.hosts[1], [PYTHON, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', %d)); c, _ = s.accept()\n"
        "while c.recv(1 << 20): pass" % PORT)])
    time.sleep(1)
    sender = bed.run(bed.hosts[0], [PYTHON, "-c", (
        "import socket, time\n"
        "c = socket.create_connection(('node1', %d)); block = bytes(1 << 20); sent = 0; t = time.monotonic()\n"
        "while time.monotonic() - t < %f: c.sendall(block); sent += len(block)\n"
        "print(sent / (time.monotonic() - t))" % (PORT, seconds))], timeout=seconds + 30)
    receiver.kill()
    return float(sender.stdout.strip())


def both_ways_bytes_per_s(bed, seconds=4.0):
    """TCP throughput of each direction while both hosts send at once, as a two-host ring
    all-reduce does (each host sends half the gradients and receives the other half, twice):
    the smaller of the two directions' rates."""
    receivers = [bed.start(bed.hosts[i], [PYTHON, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', %d)); c, _ = s.accept()\n"
        "while c.recv(1 << 20): pass" % (PORT + i))]) for i in (0, 1)]
    time.sleep(1)
    start_at = time.time() + 2  # both senders begin together
    senders = [bed.start(bed.hosts[i], [PYTHON, "-c", (
        "import socket, time\n"
        "c = socket.create_connection(('node%d', %d)); block = bytes(1 << 20); sent = 0\n"
        "time.sleep(max(0, %f - time.time())); t = time.monotonic()\n"
        "while time.monotonic() - t < %f: c.sendall(block); sent += len(block)\n"
        "print(sent / (time.monotonic() - t))" % (1 - i, PORT + 1 - i, start_at, seconds))]) for i in (0, 1)]
    rates = []
    for sender in senders:
        sender.wait(timeout=seconds + 30)
        rates.append(float(bed.output(sender).strip().splitlines()[-1]))
    for receiver in receivers:
        receiver.kill()
    return min(rates)


def launch(bed, model, config, args):
    """The windows of one run: samples/s and CPU-s/sample, summed over the ranks."""
    mode, launcher, env = config
    sync = Path(bed.root) / f"sync-{time.monotonic_ns()}"
    sync.mkdir()
    worker = HERE / ("backend_worker.py" if "KERAS_BACKEND" in env else "worker.py")
    argv = [PYTHON, worker, mode, model, "--window", args.window, "--windows", args.windows, "--sync", sync]
    if launcher == "horovod":
        commands = [[HOROVODRUN, "-np", 2, "-H", "node0:1,node1:1", "--gloo", *argv]]
    elif launcher:  # one `keras-dist launch` per machine, as a user runs it
        commands = [[KERAS_DIST, "launch", "--backend", launcher, "-n", 1, "--nnodes", 2, "--node-rank", i,
                     "--master-addr", "node0", *argv[1:]] for i in range(2)]
    else:
        commands = [argv]
    base = {**{k: v for k, v in os.environ.items() if k != "TF_CONFIG"}, "TF_CPP_MIN_LOG_LEVEL": "2",
            "TF_NUM_INTRAOP_THREADS": "1", "TF_NUM_INTEROP_THREADS": "2",
            "KERAS_DIST_JOB_SECRET": secrets.token_hex(32)}  # the machines' directory admits the job's alone
    extra = dict(setting.split("=", 1) for setting in args.env)
    processes = [bed.start(host, command, env={**base, **env, **extra}) for host, command in zip(bed.hosts, commands)]
    deadline = time.monotonic() + args.window * args.windows * 4 + 180
    try:
        for process in processes:
            process.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        for host, process in zip(bed.hosts, processes):
            bed.signal(host, 9) if process.poll() is None else None
    output = "".join(bed.output(process) for process in processes)
    reports = [json.loads(line.split("BENCH ", 1)[1]) for line in output.splitlines() if "BENCH " in line]
    if any(process.returncode != 0 for process in processes) or len(reports) != (2 if launcher else 1):
        raise RuntimeError(f"{model}/{mode} failed: {output[-2000:]}")
    windows = []
    for i in range(args.windows):
        parts = [r["windows"][i] for r in reports]
        samples = sum(p["samples"] for p in parts)
        windows.append((sum(p["samples"] / p["seconds"] for p in parts), sum(p["cpu_s"] for p in parts) / samples))
    return windows, reports[0]["params"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--rate", default="200mbit", help="tc tbf rate of every link")
    parser.add_argument("--configs", help="only these configurations (comma-separated)")
    parser.add_argument("--buckets", default="", help="bucket sizes in MiB to compare (keras_dist_2_bN)")
    parser.add_argument("--cycles", default="", help="Horovod cycle times in ms to compare (keras_dist_2_cT)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--windows", type=int, default=2)
    parser.add_argument("--link-only", action="store_true", help="measure the link and stop")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="set in every configuration's processes (repeat for several)")
    args = parser.parse_args()
    chosen = configs([float(b) for b in args.buckets.split(",") if b], [float(c) for c in args.cycles.split(",") if c])
    if args.configs:
        chosen = {k: v for k, v in chosen.items() if k in args.configs.split(",")}
    models = args.models.split(",")
    figures = {m: {name: [] for name in chosen} for m in models}
    params = {}
    with HostBed(2, rate=args.rate, pin=True, ssh=True) as bed:
        link = link_bytes_per_s(bed)
        both_ways = both_ways_bytes_per_s(bed)
        print(f"link {args.rate}: {link / 1e6:.1f} MB/s measured one way, {both_ways / 1e6:.1f} MB/s each way while "
              "both hosts send", flush=True)
        if args.link_only:
            return
        for round_ in range(args.rounds):
            for model in models:
                for name, config in chosen.items():
                    windows, params[model] = launch(bed, model, config, args)
                    figures[model][name] += windows
                    print(f"round {round_} {model}/{name}: " + ", ".join(f"{s:.0f}/s" for s, _ in windows), flush=True)
    summary = {"rate": args.rate, "link_bytes_per_s": link, "both_ways_bytes_per_s": both_ways, "models": {}}
    for model in models:
        rows = {name: {"samples_per_s": statistics.median(s for s, _ in w),
                       "cpu_s_per_sample": statistics.median(c for _, c in w)} for name, w in figures[model].items() if w}
        limits = {}
        for name, row in rows.items():
            plain = rows.get(family(name) + "plain_1")
            if plain is None:
                continue
            compute = BATCH[model] / plain["samples_per_s"]  # seconds per step on one core
            transfer = params[model] * 4 / link  # gradient bytes once each way per step
            limits[family(name)] = limit = 2 * BATCH[model] / max(compute, transfer)
            if row is plain:  # one process: the reference, not a two-host figure
                continue
            row["efficiency"] = row["samples_per_s"] / (2 * plain["samples_per_s"])
            row["of_limit"] = row["samples_per_s"] / limit
        summary["models"][model] = {"params": params[model], "overlap_limits": limits, "configs": rows}
        print(f"\n{model}: {params[model]} parameters, {params[model] * 4 / 1e6:.1f} MB of gradients; overlap limit "
              + ", ".join(f"{prefix or 'tensorflow_'}{round(limit)}" for prefix, limit in limits.items()) + " samples/s")
        print(f"{'configuration':26} {'samples/s':>10} {'CPU-ms/sample':>14} {'efficiency':>11} {'of limit':>9}")
        for name, row in rows.items():
            print(f"{name:26} {row['samples_per_s']:10.0f} {row['cpu_s_per_sample'] * 1e3:14.3f} "
                  f"{row.get('efficiency', float('nan')):11.2f} {row.get('of_limit', float('nan')):9.2f}")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
