"""Throughput of keras_dist against plain Keras and a hand-written Horovod loop.

    .venv/bin/python bench/run.py [--repeats 3] [--models cnn,mlp]

Every configuration runs in this one invocation, on this machine, so the ratios compare
like with like; absolute numbers move with machine load, ratios much less. Each worker
times several epochs after a warm-up epoch; the median epoch is reported. The last line
printed is a JSON object with all figures and `ratios`.

Configurations per model:
  plain_1        Keras `model.fit`, 1 process
  keras_dist_1   `keras_dist.compile` + fit, 1 process (single backend)
  handwritten_2  hand-written Horovod Keras 3 loop, 2 processes x 1 thread
  keras_dist_2   keras_dist Horovod backend, 2 processes x 1 thread
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")
STEPS = {"cnn": 20, "mlp": 60}


def launch(mode, model, processes, repeats, threads):
    argv = [PYTHON, str(HERE / "worker.py"), mode, model, str(repeats + 1), str(STEPS[model])]
    if processes > 1:
        argv = [HOROVODRUN, "-np", str(processes), "-H", f"localhost:{processes}", "--gloo", *argv]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": str(threads)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=900, start_new_session=True)
    reports = [json.loads(line.split("BENCH ", 1)[1]) for line in out.stdout.splitlines() if "BENCH " in line]
    if out.returncode != 0 or len(reports) != processes:
        raise SystemExit(f"{mode} {model} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    # Per epoch, the job's throughput is the sum over ranks; take the median epoch.
    per_epoch = [sum(r["samples_per_s"][i] for r in reports) for i in range(repeats)]
    return statistics.median(per_epoch), reports[0]["params"]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="cnn,mlp")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()
    results, ratios = {}, {}
    for model in args.models.split(","):
        runs = {}
        for name, mode, processes in [("plain_1", "plain", 1), ("keras_dist_1", "keras_dist", 1),
                                      ("handwritten_2", "handwritten", 2), ("keras_dist_2", "keras_dist", 2)]:
            runs[name], params = launch(mode, model, processes, args.repeats, args.threads)
            print(f"{model:4s} {name:14s} {runs[name]:10.1f} samples/s", flush=True)
        results[model] = {"params": params, "samples_per_s": runs}
        ratios[f"{model}_keras_dist_1_vs_plain_1"] = runs["keras_dist_1"] / runs["plain_1"]
        ratios[f"{model}_keras_dist_2_vs_handwritten_2"] = runs["keras_dist_2"] / runs["handwritten_2"]
        ratios[f"{model}_keras_dist_2_vs_plain_1"] = runs["keras_dist_2"] / runs["plain_1"]
    print(json.dumps({"results": results, "ratios": {k: round(v, 3) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
