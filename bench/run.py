"""Throughput of keras_dist against plain Keras and a hand-written Horovod loop.

    .venv/bin/python bench/run.py [--repeats 3] [--models cnn,mlp,emb]

Every configuration runs in this one invocation, on this machine, so the ratios compare
like with like; absolute numbers move with machine load, ratios much less. Each worker
times several epochs after a warm-up epoch; the median epoch is reported. The last line
printed is a JSON object with all figures and `ratios`.

Configurations per model:
  plain_1             Keras `model.fit`, 1 process
  keras_dist_1        `keras_dist.compile` + fit, 1 process (single backend)
  handwritten_2       hand-written Horovod Keras 3 loop, 2 processes x 1 thread
  keras_dist_2        keras_dist Horovod backend, 2 processes x 1 thread
  handwritten_mwms_2  hand-written MultiWorkerMirroredStrategy loop, 2 processes x 1 thread
  keras_dist_mwms_2   keras_dist multi_worker_mirrored backend, 2 processes x 1 thread
  keras_dist_ps_1     keras_dist parameter_server backend: chief + 1 worker + 1 ps
  keras_dist_ps_2     the same with 2 workers (asynchronous steps; the ratio is steps/s)
The embedding model (`emb`, a 12.8 MB table) runs plain_1 and, with 2 workers and 2 ps:
  ps_whole_2          the table whole on one ps task
  ps_sharded_2        the table split over both (KERAS_DIST_MIN_SHARD_BYTES=1 MiB)
Strategy workers get TF_CONFIG on free 127.0.0.1 ports, as `keras-dist launch` gives them.
"""

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from keras_dist.launcher import kill_process_groups

HERE = Path(__file__).resolve().parent
PYTHON = sys.executable
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")
STEPS = {"cnn": 20, "mlp": 60, "emb": 100}


def launch(mode, model, processes, repeats, threads, launcher, num_ps=0, extra_env=None):
    """Median samples/s of `processes` workers of `mode`, started by `launcher`.

    `launcher`: None (one plain process), "horovod", or a keras_dist backend name whose
    `local_tasks` give the processes (multi_worker_mirrored, parameter_server, with
    `num_ps` ps tasks). `extra_env` goes to every process.
    """
    argv = [str(HERE / "worker.py"), mode, model, str(repeats + 1), str(STEPS[model])]
    if launcher is None:
        commands = [([PYTHON, *argv], {}, False)]
    elif launcher == "horovod":
        commands = [([HOROVODRUN, "-np", str(processes), "-H", f"localhost:{processes}", "--gloo", PYTHON, *argv],
                     {}, False)]
    else:
        from keras_dist.backends import backend_class

        commands = [(t.argv, t.env, t.serves) for t in backend_class(launcher).local_tasks(processes, num_ps, argv)]
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_NUM_INTRAOP_THREADS": str(threads), **(extra_env or {})}
    codes, output = run_together(commands, env, timeout=900)
    reports = [json.loads(line.split("BENCH ", 1)[1]) for line in output.splitlines() if "BENCH " in line]
    reporting = sum(1 for _, _, serves in commands if not serves) * (processes if launcher == "horovod" else 1)
    if any(codes) or len(reports) != reporting:
        raise SystemExit(f"{mode} {model} ({launcher}) failed with exit codes {codes}:\n{output[-6000:]}")
    # Per epoch, the job's throughput is the sum over ranks; take the median epoch.
    per_epoch = [sum(r["samples_per_s"][i] for r in reports) for i in range(repeats)]
    return statistics.median(per_epoch), reports[0]["params"]


def run_together(commands, env, timeout):
    """Runs `(argv, extra_env, serves)` commands at once; returns the exit codes and joined output.

    Commands that serve (parameter-server workers and ps tasks) run until the others end.

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
        try:
            for proc, (_, _, serves) in zip(procs, commands):
                if not serves:
                    proc.wait(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise SystemExit(f"{commands[0][0][:4]} did not finish in {timeout}s") from None
        finally:
            kill_process_groups(procs)
        for out in outputs:
            out.seek(0)
        codes = [proc.returncode for proc, (_, _, serves) in zip(procs, commands) if not serves]
        return codes, "".join(out.read() for out in outputs)


SHARDED = {"KERAS_DIST_MIN_SHARD_BYTES": str(1 << 20)}
# model kind -> configurations: (name, worker mode, processes, launcher, ps tasks, extra environment)
CONFIGS = {
    "dense": [
        ("plain_1", "plain", 1, None, 0, {}), ("keras_dist_1", "keras_dist", 1, None, 0, {}),
        ("handwritten_2", "handwritten", 2, "horovod", 0, {}), ("keras_dist_2", "keras_dist", 2, "horovod", 0, {}),
        ("handwritten_mwms_2", "handwritten_mwms", 2, "multi_worker_mirrored", 0, {}),
        ("keras_dist_mwms_2", "keras_dist", 2, "multi_worker_mirrored", 0, {}),
        ("keras_dist_ps_1", "keras_dist", 1, "parameter_server", 1, {}),
        ("keras_dist_ps_2", "keras_dist", 2, "parameter_server", 1, {}),
    ],
    "emb": [
        ("plain_1", "plain", 1, None, 0, {}), ("ps_whole_2", "keras_dist", 2, "parameter_server", 2, {}),
        ("ps_sharded_2", "keras_dist", 2, "parameter_server", 2, SHARDED),
    ],
}
# model kind -> ratios: (name, numerator, denominator)
RATIOS = {
    "dense": [
        ("keras_dist_1_vs_plain_1", "keras_dist_1", "plain_1"),
        ("keras_dist_2_vs_handwritten_2", "keras_dist_2", "handwritten_2"),
        ("keras_dist_2_vs_plain_1", "keras_dist_2", "plain_1"),
        ("keras_dist_mwms_2_vs_handwritten_mwms_2", "keras_dist_mwms_2", "handwritten_mwms_2"),
        ("keras_dist_mwms_2_vs_keras_dist_horovod_2", "keras_dist_mwms_2", "keras_dist_2"),
        ("keras_dist_ps_2_vs_ps_1", "keras_dist_ps_2", "keras_dist_ps_1"),
        ("keras_dist_ps_1_vs_plain_1", "keras_dist_ps_1", "plain_1"),
    ],
    "emb": [("ps_sharded_2_vs_ps_whole_2", "ps_sharded_2", "ps_whole_2"), ("ps_whole_2_vs_plain_1", "ps_whole_2", "plain_1")],
}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--models", default="cnn,mlp,emb")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process")
    args = parser.parse_args()
    results, ratios = {}, {}
    for model in args.models.split(","):
        kind = "emb" if model == "emb" else "dense"
        runs = {}
        for name, mode, processes, launcher, num_ps, extra_env in CONFIGS[kind]:
            runs[name], params = launch(mode, model, processes, args.repeats, args.threads, launcher, num_ps, extra_env)
            print(f"{model:4s} {name:14s} {runs[name]:10.1f} samples/s", flush=True)
        results[model] = {"params": params, "samples_per_s": runs}
        for name, numerator, denominator in RATIOS[kind]:
            ratios[f"{model}_{name}"] = runs[numerator] / runs[denominator]
    print(json.dumps({"results": results, "ratios": {k: round(v, 3) for k, v in ratios.items()}}))


if __name__ == "__main__":
    main()
