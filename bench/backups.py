"""What a backup every 5 steps costs a training step: keras_dist's background writes against none.

    .venv/bin/python bench/backups.py [--models cnn,state_100mb] [--rounds 2] [--window 20]
                                      [--backend tensorflow] [--every 5]

Configurations, each one process, alternated (A B C A B C ...), one launch each per round:
  none          `keras_dist.compile` + fit, no backup
  keras_dist    the same with `keras.callbacks.BackupAndRestore(dir, save_freq=EVERY)`:
                keras_dist copies the state to host memory at the step and writes it in a
                thread (keras_dist/fault_tolerance/background_writes.py)
  keras         plain Keras (no keras_dist) with the same `BackupAndRestore`: Keras writes
                the backup in the training thread, as users had it

Models: cnn (bench/models.py, batch 64) and state_100mb (an MLP of 8.4M parameters: weights
and Adam's two moments are 101 MB, batch 128). Each launch trains one warm-up epoch, then
whole epochs into one window of at least --window seconds (bench/windows.py), with one
intra-op thread, so that the writing thread has the machine's other core as on a machine
whose CPUs feed accelerators. Reported: the median over rounds of steps/s and CPU-s per
step, and the ratio of time per step with a backup to time per step without.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = ("none", "keras_dist", "keras")


def worker(config: str, model_name: str, window: float, every: int) -> None:
    if config != "keras":
        import keras_dist
    import keras
    import numpy as np

    sys.path.insert(0, HERE)
    from models import CNN_BATCH, CNN_INPUT, cnn_layers
    from windows import Windows

    if keras.backend.backend() == "tensorflow":
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    elif keras.backend.backend() == "torch":
        import torch

        torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    if model_name == "cnn":
        layers, shape, batch, steps = [keras.Input(CNN_INPUT), *cnn_layers()], CNN_INPUT, CNN_BATCH, 50
    else:
        layers = [keras.Input((1024,)), keras.layers.Dense(4096, activation="relu"),
                  keras.layers.Dense(1024, activation="relu"), keras.layers.Dense(10)]
        shape, batch, steps = (1024,), 128, 50
    x = rng.normal(size=(batch * steps, *shape)).astype("float32")
    y = rng.integers(0, 10, size=batch * steps)
    model = keras.Sequential(layers)
    arguments = dict(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if config == "keras":
        model.compile(**arguments)
    else:
        keras_dist.compile(model, **arguments)
    windows = Windows(0, None, window, 1)

    class Measure(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if windows.epoch_end(batch * steps):
                self.model.stop_training = True

    callbacks = [Measure()]
    with tempfile.TemporaryDirectory() as directory:
        if config != "none":
            callbacks.insert(0, keras.callbacks.BackupAndRestore(directory, save_freq=every))
        model.fit(x, y, batch_size=batch, epochs=10_000, shuffle=False, verbose=0, callbacks=callbacks)
    result = windows.windows[0]
    print("BENCH " + json.dumps({"steps_per_s": result["samples"] / batch / result["seconds"],
                                 "cpu_s_per_step": result["cpu_s"] / (result["samples"] / batch)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--models", default="cnn,state_100mb")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--window", type=float, default=20.0)
    parser.add_argument("--backend", default="tensorflow")
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--worker", nargs=2, metavar=("CONFIG", "MODEL"))
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.window, args.every)
        return
    env = {**os.environ, "KERAS_BACKEND": args.backend, "TF_CPP_MIN_LOG_LEVEL": "2", "OMP_NUM_THREADS": "1",
           "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"}
    results: dict = {}
    started = time.time()
    for round_ in range(args.rounds):
        for model_name in args.models.split(","):
            for config in CONFIGS:
                out = subprocess.run([sys.executable, __file__, "--worker", config, model_name, "--window",
                                      str(args.window), "--every", str(args.every)], env=env, capture_output=True,
                                     text=True, timeout=600)
                lines = [line for line in out.stdout.splitlines() if line.startswith("BENCH ")]
                if out.returncode or not lines:
                    raise SystemExit(f"{config} {model_name} failed:\n{out.stderr[-3000:]}")
                figures = json.loads(lines[-1][6:])
                results.setdefault((model_name, config), []).append(figures)
                print(f"round {round_ + 1} {model_name:12} {config:10} {figures['steps_per_s']:8.2f} steps/s "
                      f"{figures['cpu_s_per_step'] * 1000:8.1f} CPU-ms/step", flush=True)
    print(f"\n{args.backend}, backup every {args.every} steps, {args.rounds} rounds of {args.window:.0f} s windows, "
          f"{time.time() - started:.0f} s in all\n")
    print("| model | configuration | steps/s | CPU-ms/step | time per step / none |")
    print("| --- | --- | --- | --- | --- |")
    summary = {}
    for model_name in args.models.split(","):
        base = statistics.median(r["steps_per_s"] for r in results[(model_name, "none")])
        for config in CONFIGS:
            rate = statistics.median(r["steps_per_s"] for r in results[(model_name, config)])
            cpu = statistics.median(r["cpu_s_per_step"] for r in results[(model_name, config)])
            summary[f"{model_name}/{config}"] = base / rate
            print(f"| {model_name} | {config} | {rate:.2f} | {cpu * 1000:.1f} | {base / rate:.3f} |")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
