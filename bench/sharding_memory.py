"""Per-process memory of Adam's state, unsharded and sharded (`shard=`), measured.

    .venv/bin/python bench/sharding_memory.py [--backend torch|jax|tensorflow] [--processes 2] [--width 4096] [--rounds 2]
    .venv/bin/python bench/sharding_memory.py --backend jax --cap-mib 2200
    .venv/bin/python bench/sharding_memory.py --backend torch --settings unsharded,optimizer --restore
    .venv/bin/python bench/sharding_memory.py --backend torch --settings unsharded,optimizer --chief-loads

`--settings split,weights` picks settings; `split` builds the model inside
`keras_dist.split_weights()` (PyTorch).

With --restore, each job runs twice: the first writes a `BackupAndRestore` backup after
step 4 and every process ends there; the second restores it at fit's start, and each
process reports its peak resident memory up to its first step (the restore and the
initial sync, before any training) beside the peak of the whole run.

With --chief-loads, each job runs twice too: the first trains and saves its weights
(`save_weights`, with the optimizer's state); the second trains a step (which builds the
optimizer), then the chief alone loads that file, as a script may, and fit runs again:
"before the first step" is then the peak from the load to that fit's first step (the
initial sync hands every process the chief's state), the peak reset at the load
(`/proc/self/clear_refs`).

Each round runs, alternated, `keras-dist launch -n N` on Keras's PyTorch (or JAX, or TensorFlow under Horovod) backend
of an MLP (3 Dense layers of --width units and one of 10: about 50M weights at 4096) trained 6 steps
with Adam, once unsharded and once per level of sharding the backend has ("optimizer";
JAX and PyTorch: "weights" too). Every process reports the bytes of its optimizer's variables that
it holds and its peak resident memory (`ru_maxrss`); printed: a line per process, then
the medians of each setting and their ratios to unsharded, and as the last line a JSON
object.

With --cap-mib, each process's data memory is capped (`RLIMIT_DATA`, as
tests/workers/memory_cap.py does) and, for each setting, the widest MLP (a multiple of
256 units) that still trains is found by bisection; printed: a line per try, then the
widest per setting and its weights.
"""

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(out: str, width: int, shard: str | None, cap_mib: int | None, phase: str | None = None) -> None:
    if cap_mib:  # before the frameworks load, as on a device: what they allocate counts
        resource.setrlimit(resource.RLIMIT_DATA, (cap_mib * 2**20, cap_mib * 2**20))
    import keras
    import numpy as np

    import keras_dist

    context = keras_dist.init()
    keras.utils.set_random_seed(0)
    building = keras_dist.split_weights() if shard == "split" else contextlib.nullcontext()
    with building:
        model = keras.Sequential([keras.Input((width,)),
                                  *[keras.layers.Dense(width, activation="relu") for _ in range(3)],
                                  keras.layers.Dense(10)])
    keras_dist.compile(model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       **({"shard": shard} if shard in ("optimizer", "weights") else {}))
    x = np.random.default_rng(0).normal(size=(6 * 16 * context.size, width)).astype("float32")
    y = np.zeros(len(x), "int32")
    before_training = {}
    saved = os.path.join(out, "saved.weights.h5")
    if phase == "chief loads":
        model.fit(x[:16 * context.size], y[:16 * context.size], batch_size=16, verbose=0)  # builds the optimizer
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak resident memory starts again from the current
        if context.is_chief:
            model.load_weights(saved)

    def peak() -> int:
        if phase != "chief loads":
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))

    class Phases(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: dict | None = None) -> None:
            before_training.setdefault("peak", peak())

        def on_train_batch_end(self, batch: int, logs: dict | None = None) -> None:
            if phase == "backup" and batch == 3:  # after the backup of step 4, on disk
                from keras_dist.fault_tolerance import background_writes

                background_writes.wait_for_all()
                os._exit(0)

    backup = [keras.callbacks.BackupAndRestore(os.path.join(out, "backup"), save_freq=2)] if phase in (
        "backup", "restore") else []
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0, callbacks=[*backup, Phases()])
    if phase == "save":
        model.save_weights(saved)
    report = {"rank": context.rank, "weights": model.count_params(),
              "peak_rss_before_training_bytes": before_training["peak"],
              "optimizer_bytes": sum(held_bytes(v) for v in model.optimizer.variables),
              "peak_rss_bytes": peak()}
    with open(os.path.join(out, f"memory-{context.rank}.json"), "w") as f:
        json.dump(report, f)


def held_bytes(variable) -> int:
    """The bytes of a float32 variable this process holds: its own parts where JAX splits it."""
    import numpy as np

    shards = getattr(variable.value, "addressable_shards", None)
    shapes = [shard.data.shape for shard in shards] if shards is not None else [variable.shape]
    return sum(int(np.prod(shape)) * 4 for shape in shapes)


def measure(backend: str, processes: int, width: int, shard: str | None, cap_mib: int | None = None,
            phases: tuple = (None,)) -> list[dict]:
    """Every process's report (of the last of `phases`: the restoring run, or the chief's
    load); empty where the job failed (under a cap: out of memory)."""
    with tempfile.TemporaryDirectory() as out:
        for phase in phases:
            command = [str(Path(sys.executable).parent / "keras-dist"), "launch", "-n", str(processes),
                       __file__, "--worker", out, "--width", str(width), *(["--shard", shard] if shard else []),
                       *(["--cap-mib", str(cap_mib)] if cap_mib else []), *(["--phase", phase] if phase else [])]
            done = subprocess.run(command, timeout=1200, env={**os.environ, "KERAS_BACKEND": backend},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            if done.returncode != 0:
                if cap_mib:
                    return []
                raise RuntimeError(f"{command} exited with {done.returncode}")
        return [json.loads(Path(out, f"memory-{rank}.json").read_text()) for rank in range(processes)]


def widest_under_cap(backend: str, processes: int, shard: str | None, cap_mib: int) -> dict:
    """The widest MLP (a multiple of 256 units) that trains with every process under `cap_mib`,
    and its weights."""
    low, high, weights = 0, 48, 0  # in units of 256: trains at low (0: nothing tried), fails at high
    while high - low > 1:
        middle = (low + high) // 2
        reports = measure(backend, processes, middle * 256, shard, cap_mib)
        print(f"{shard or 'unsharded':9} width {middle * 256}: {'trains' if reports else 'out of memory'}", flush=True)
        if reports:
            low, weights = middle, reports[0]["weights"]
        else:
            high = middle
    return {"width": low * 256, "weights": weights}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--backend", choices=["torch", "jax", "tensorflow"], default="torch")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cap-mib", type=int)
    parser.add_argument("--settings", help="comma-separated, of: unsharded, optimizer, weights, split (PyTorch: the "
                                           "model built in keras_dist.split_weights()); default: all the backend has "
                                           "but split")
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=["backup", "restore", "save", "chief loads"], help=argparse.SUPPRESS)
    parser.add_argument("--restore", action="store_true", help="measure a backup's restore (see above)")
    parser.add_argument("--chief-loads", action="store_true", help="measure the chief's load before fit (see above)")
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.width, args.shard, args.cap_mib, args.phase)
    settings = {"unsharded": None, "optimizer": "optimizer", **({"weights": "weights"} if args.backend in ("jax", "torch") else {})}
    if args.settings:
        chosen = args.settings.split(",")
        settings = {name: None if name == "unsharded" else name for name in chosen}
    if args.cap_mib:
        widest = {name: widest_under_cap(args.backend, args.processes, shard, args.cap_mib)
                  for name, shard in settings.items()}
        for name, found in widest.items():
            print(f"under {args.cap_mib} MiB a process, {args.processes} processes, {name}: widest {found['width']} "
                  f"({found['weights']} weights)")
        print(json.dumps({"backend": args.backend, "processes": args.processes, "cap_mib": args.cap_mib,
                          "widest": widest}))
        return
    found: dict[str, list[dict]] = {name: [] for name in settings}
    for round_number in range(args.rounds):
        for name, shard in settings.items():
            phases = ("backup", "restore") if args.restore else ("save", "chief loads") if args.chief_loads else (None,)
            for report in measure(args.backend, args.processes, args.width, shard, phases=phases):
                found[name].append(report)
                print(f"round {round_number + 1} {name:9} rank {report['rank']}: {report['weights']} weights, optimizer "
                      f"{report['optimizer_bytes'] / 2**20:.1f} MiB, peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB "
                      f"({report['peak_rss_before_training_bytes'] / 2**20:.0f} MiB before the first step)", flush=True)
    keys = ("optimizer_bytes", "peak_rss_bytes", "peak_rss_before_training_bytes")
    medians = {name: {key: statistics.median(r[key] for r in reports) for key in keys} for name, reports in found.items()}
    ratios = {name: {key: medians[name][key] / medians["unsharded"][key] for key in keys}
              for name in settings if name != "unsharded" and "unsharded" in medians}
    for name, ratio in ratios.items():
        print(f"{name} / unsharded, medians over processes and rounds: optimizer state "
              f"{ratio['optimizer_bytes']:.3f}, peak RSS {ratio['peak_rss_bytes']:.3f}, before the first step "
              f"{ratio['peak_rss_before_training_bytes']:.3f}")
    print(json.dumps({"backend": args.backend, "processes": args.processes, "width": args.width,
                      "restore": args.restore, "chief_loads": args.chief_loads, "medians": medians,
                      "ratios": ratios, "runs": found}))


if __name__ == "__main__":
    main()
