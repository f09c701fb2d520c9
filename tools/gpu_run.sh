#!/usr/bin/env bash
# The one command for the device machine (one NVIDIA GPU, PyTorch and JAX with CUDA, no
# TensorFlow, no network): tests/gpu, then bench/gpu.py, each under a hard time limit,
# with their outputs under $OUT (default: /tmp/keras_dist_gpu_run).
#   device:   tools/gpu_run.sh                 (carry .whl: Keras and what it needs beyond the image)
#   dry run:  GPU_RUN_DRY=1 tools/gpu_run.sh   (on CPUs: the tests rehearsed, the bench at tiny sizes)
#   GPU_TESTS_SECONDS / GPU_BENCH_SECONDS: each part's limit (200 / 300 s); 0 skips the bench
# .whl holds keras, namex and optree wheels for CPython 3.12 (`pip download --no-deps
# --only-binary=:all: --python-version 3.12 ...`, as the device tool's README says).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/keras_dist_gpu_run}
GPU_BENCH_SECONDS=${GPU_BENCH_SECONDS:-300}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
if [ "${GPU_RUN_DRY:-0}" = 1 ]; then
  export KERAS_DIST_GPU_TESTS_ON_CPU=1
  smoke=--smoke
else
  smoke=
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
  { nvidia-smi -L; ls /proc/driver/nvidia/gpus /dev/nvidia*; } 2>&1 | tee "$OUT/device.txt"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The image has no TensorFlow, Keras's default backend; each test and bench process sets its own.
export KERAS_BACKEND=${KERAS_BACKEND:-torch}
"$PYTHON" -c "import sys, keras, numpy, jax, torch; print(sys.version.split()[0], 'keras', keras.__version__, 'jax', jax.__version__, jax.devices(), 'torch', torch.__version__, torch.cuda.is_available())" 2>&1 | tail -1 | tee -a "$OUT/device.txt"
timeout -k 10 "${GPU_TESTS_SECONDS:-200}" "$PYTHON" -m pytest -p no:cacheprovider -v -rs tests/gpu 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASSED|FAILED|SKIPPED|ERROR|passed|failed"
tests=${PIPESTATUS[0]}
bench=0
if [ "${GPU_BENCH_SECONDS:-300}" -gt 0 ]; then
  timeout -k 10 "$GPU_BENCH_SECONDS" "$PYTHON" bench/gpu.py --out "$OUT" $smoke --timeout "$(( GPU_BENCH_SECONDS - 15 ))" 2>&1 | tee "$OUT/gpu_bench.log" | tail -8
  bench=${PIPESTATUS[0]}
fi
echo "tests/gpu exit $tests, bench/gpu.py exit $bench"
[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
