"""Per-process memory of Adam's state, unsharded and sharded (`shard="optimizer"`), measured.

    .venv/bin/python bench/sharding_memory.py [--processes 2] [--width 4096] [--rounds 2]

Each round runs, alternated, `keras-dist launch -n N` on Keras's PyTorch backend of an MLP
(4 Dense layers of --width units: about 50M weights at 4096) trained 6 steps with Adam,
once unsharded and once sharded. Every process reports the bytes of its optimizer's
variables and its peak resident memory (`ru_maxrss`); printed: a line per process, then
the medians of both settings and their ratios, and as the last line a JSON object.
"""

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def worker(out: str, width: int, shard: str | None) -> None:
    import keras
    import numpy as np

    import keras_dist

    context = keras_dist.init()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((width,)), *[keras.layers.Dense(width, activation="relu") for _ in range(3)],
                              keras.layers.Dense(10)])
    keras_dist.compile(model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                       **({"shard": shard} if shard else {}))
    x = np.random.default_rng(0).normal(size=(6 * 16 * context.size, width)).astype("float32")
    y = np.zeros(len(x), "int32")
    model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    report = {"rank": context.rank, "weights": model.count_params(),
              "optimizer_bytes": sum(int(np.prod(v.shape)) * 4 for v in model.optimizer.variables),
              "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    with open(os.path.join(out, f"memory-{context.rank}.json"), "w") as f:
        json.dump(report, f)


def measure(processes: int, width: int, shard: str | None) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        command = [str(Path(sys.executable).parent / "keras-dist"), "launch", "-n", str(processes),
                   __file__, "--worker", out, "--width", str(width), *(["--shard", shard] if shard else [])]
        subprocess.run(command, check=True, timeout=1200, env={**os.environ, "KERAS_BACKEND": "torch"},
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return [json.loads(Path(out, f"memory-{rank}.json").read_text()) for rank in range(processes)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shard", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.width, args.shard)
    found: dict[str, list[dict]] = {"unsharded": [], "sharded": []}
    for round_number in range(args.rounds):
        for name, shard in (("unsharded", None), ("sharded", "optimizer")):
            for report in measure(args.processes, args.width, shard):
                found[name].append(report)
                print(f"round {round_number + 1} {name:9} rank {report['rank']}: {report['weights']} weights, optimizer "
                      f"{report['optimizer_bytes'] / 2**20:.1f} MiB, peak RSS {report['peak_rss_bytes'] / 2**20:.0f} MiB",
                      flush=True)
    medians = {name: {key: statistics.median(r[key] for r in reports) for key in ("optimizer_bytes", "peak_rss_bytes")}
               for name, reports in found.items()}
    ratios = {key: medians["sharded"][key] / medians["unsharded"][key] for key in ("optimizer_bytes", "peak_rss_bytes")}
    print(f"sharded / unsharded, medians over processes and rounds: optimizer state {ratios['optimizer_bytes']:.3f}, "
          f"peak RSS {ratios['peak_rss_bytes']:.3f}")
    print(json.dumps({"processes": args.processes, "width": args.width, "medians": medians, "ratios": ratios,
                      "runs": found}))


if __name__ == "__main__":
    main()
