"""keras_dist's cost over plain Keras `fit` in one process on a GPU, on JAX and PyTorch.

    python bench/gpu.py --out DIR [--smoke]

For each model (ResNet-50 in mixed_bfloat16 at batch 256 on 224x224 images, and the
bench's CNN in float32 at batch 64), backend and mode, one fresh process trains on
synthetic uint8 images (cast on the device) and measures whole epochs in windows
(bench/windows.py; epoch 0 compiles and warms up). `keras_dist` is the two-line change
with the backend's strategy engaged (`KERAS_DIST_BACKEND`, as `keras_dist.init(backend=)`
on a machine with one GPU); `plain` is `model.compile`. After its windows a keras_dist run
profiles a few more steps (cProfile) and reports the Python time spent in keras_dist's
own functions per step, an upper bound of what it adds (profiling slows Python down).

Configurations run one after another (never two on the GPU at once); each result is
appended to DIR/gpu.json as it comes, and DIR/gpu.md gets the table. `--smoke` runs
tiny sizes on CPUs, for tools/gpu_run.sh's dry run.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = {  # name: (batch, steps per epoch, image side, policy, window seconds, windows)
    "resnet50": (256, 8, 224, "mixed_bfloat16", 3.0, 3),
    "cnn": (64, 20, 32, "float32", 1.5, 3),
}
SMOKE = {"resnet50": (4, 2, 32, "mixed_bfloat16", 0.5, 2), "cnn": (8, 4, 32, "float32", 0.5, 2)}
# PyTorch first: its ResNet-50 runs 6x slower, so a cut-off run still has the JAX anchor after it.
ORDER = [(model, backend, mode) for model in ("resnet50", "cnn") for backend in ("torch", "jax")
         for mode in ("plain", "keras_dist")]


def child(model_name: str, mode: str, sizes: tuple) -> None:
    """One measured process (KERAS_BACKEND set by the parent); prints one `BENCH {json}` line."""
    batch, steps, side, policy, window, windows_wanted = sizes
    import cProfile
    import pstats

    import keras
    import numpy as np

    sys.path.insert(0, str(HERE))
    from models import cnn_layers
    from windows import Windows

    if mode == "keras_dist":
        import keras_dist
    keras.mixed_precision.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    if model_name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(side, side, 3), classes=1000,
                                            classifier_activation=None)
        classes = 1000
    else:
        model = keras.Sequential([keras.Input((side, side, 3)), *cnn_layers()])
        classes = 10
    kwargs = dict(optimizer=keras.optimizers.SGD(0.01, momentum=0.9),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.compile(**kwargs) if mode == "plain" else keras_dist.compile(model, **kwargs)
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (steps * batch, side, side, 3), dtype=np.uint8)
    y = rng.integers(0, classes, steps * batch).astype("int32")
    measured = Windows(0, None, window, windows_wanted)

    class Measure(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if measured.epoch_end(steps * batch):
                self.model.stop_training = True

    started = time.perf_counter()
    model.fit(x, y, batch_size=batch, epochs=100000, shuffle=False, verbose=0, callbacks=[Measure()])
    result = {"windows": measured.windows, "first_epoch_and_windows_s": time.perf_counter() - started}
    if mode == "keras_dist":
        profiler = cProfile.Profile()
        profiler.enable()
        model.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
        profiler.disable()
        own = [(f"{Path(file).name}:{function}", stat[2]) for (file, _, function), stat in
               pstats.Stats(profiler).stats.items() if f"{os.sep}keras_dist{os.sep}" in file]
        own.sort(key=lambda item: -item[1])
        result["keras_dist_python_ms_per_step"] = 1000 * sum(t for _, t in own) / steps
        result["keras_dist_top"] = [(name, round(1000 * t / steps, 3)) for name, t in own[:6]]
        result["strategy"] = keras_dist.current().name
    if keras.backend.backend() == "torch":
        import torch

        result["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    else:
        import jax

        result["device"] = str(jax.devices()[0].device_kind)
    print("BENCH " + json.dumps(result), flush=True)


def parent(out: Path, smoke: bool, timeout: float) -> None:
    out.mkdir(parents=True, exist_ok=True)
    runs, deadline = [], time.monotonic() + timeout
    for model, backend, mode in ORDER:
        left = deadline - time.monotonic()
        if left < 20:
            print(f"bench/gpu.py: out of time before {model} {backend} {mode}", flush=True)
            break
        env = {**os.environ, "KERAS_BACKEND": backend, "PYTHONUNBUFFERED": "1"}
        if mode == "keras_dist":
            env["KERAS_DIST_BACKEND"] = backend
        command = [sys.executable, __file__, "--child", model, mode] + (["--smoke"] if smoke else [])
        started = time.perf_counter()
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=left)
            lines = [line for line in done.stdout.splitlines() if line.startswith("BENCH ")]
            tail = (done.stdout + done.stderr)[-2000:]
        except subprocess.TimeoutExpired:
            lines, tail = [], "timed out"
        run = {"model": model, "backend": backend, "mode": mode, "wall_s": round(time.perf_counter() - started, 1)}
        if lines:
            run.update(json.loads(lines[-1][6:]))
            batch_rates = [w["samples"] / w["seconds"] for w in run["windows"]]
            run["img_per_s"] = statistics.median(batch_rates)
            run["cpu_s_per_1000_img"] = statistics.median(1000 * w["cpu_s"] / w["samples"] for w in run["windows"])
        else:
            run["error"] = tail
        runs.append(run)
        print(json.dumps({k: v for k, v in run.items() if k != "windows"}), flush=True)
        (out / "gpu.json").write_text(json.dumps(runs, indent=1))
    (out / "gpu.md").write_text(table(runs))
    print(table(runs), flush=True)


def table(runs: list) -> str:
    rows = ["| backend | model | device | plain img/s | keras_dist img/s | ratio | CPU s/1000 img plain / keras_dist "
            "| keras_dist Python ms/step (profiled) |", "|---|---|---|---|---|---|---|---|"]
    by = {(r["model"], r["backend"], r["mode"]): r for r in runs}
    for model in MODELS:
        for backend in ("jax", "torch"):
            plain, ours = by.get((model, backend, "plain"), {}), by.get((model, backend, "keras_dist"), {})
            if "img_per_s" not in plain or "img_per_s" not in ours:
                continue
            rows.append(f"| {backend} | {model} | {ours.get('device')} | {plain['img_per_s']:.0f} | "
                        f"{ours['img_per_s']:.0f} | {ours['img_per_s'] / plain['img_per_s']:.3f} | "
                        f"{plain['cpu_s_per_1000_img']:.2f} / {ours['cpu_s_per_1000_img']:.2f} | "
                        f"{ours['keras_dist_python_ms_per_step']:.2f} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--timeout", type=float, default=300, help="seconds for all configurations together")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"))
    args = parser.parse_args()
    if args.child:
        model, mode = args.child
        child(model, mode, (SMOKE if args.smoke else MODELS)[model])
    else:
        parent(args.out, args.smoke, args.timeout)


main()
