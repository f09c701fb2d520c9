"""Per-call overhead on Keras's JAX backend: a guide-shaped script (bench/guide_script.py)
as one process and as 2 processes under `keras-dist launch`, alternated.

    .venv/bin/python bench/guide_overhead.py [--rounds 3] [--sections 5]

Prints each run's wall time (the script's own, from its first model to its end, so
interpreter and import time are left out) and CPU-seconds of all its processes, then
the medians and the ratio 2 processes / 1 process (1.0: no overhead from distribution).
"""

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
SCRIPT = ROOT / "bench" / "guide_script.py"


def run(command, sections):
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    env = {**os.environ, "KERAS_BACKEND": "jax", "TF_CPP_MIN_LOG_LEVEL": "2"}
    out = subprocess.run([*command, SCRIPT, str(sections)], env=env, capture_output=True, text=True, timeout=900)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    seconds = [float(s) for s in re.findall(r"seconds ([0-9.]+)", out.stdout + out.stderr)]
    if out.returncode != 0 or not seconds:
        raise SystemExit(f"{command} failed:\n{(out.stdout + out.stderr)[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return max(seconds), cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sections", type=int, default=5)
    args = parser.parse_args()
    configurations = {"plain_1": [sys.executable], "keras_dist_2": [BIN / "keras-dist", "launch", "-n", "2"]}
    figures = {name: [] for name in configurations}
    for round_ in range(args.rounds):
        for name, command in configurations.items():
            figures[name].append(run(command, args.sections))
            print(f"round {round_} {name}: {figures[name][-1][0]:.1f} s, {figures[name][-1][1]:.1f} CPU-s", flush=True)
    medians = {name: (statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs))
               for name, runs in figures.items()}
    for name, (wall, cpu) in medians.items():
        print(f"{name:14s} median {wall:6.1f} s  {cpu:6.1f} CPU-s")
    print(f"keras_dist_2 / plain_1 wall time: {medians['keras_dist_2'][0] / medians['plain_1'][0]:.2f}")


if __name__ == "__main__":
    main()
