#!/usr/bin/env bash
# The project's two entry points; each first creates (or reuses) what it needs:
#   ./dev.sh train   train the example with 2 Horovod processes on this machine
#   ./dev.sh test    run the test suite (extra arguments go to pytest, else the multi-host tests run beside the rest)
# Needs Python >= 3.10 with venv and pip, gcc/g++ and cmake (Horovod is compiled once).
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}

need() { command -v "$1" >/dev/null || { echo "error: '$1' not found; install it first ($2)" >&2; exit 1; }; }
need "$PYTHON" "Python 3.10 or newer"
need gcc "Debian/Ubuntu: apt-get install -y gcc"
need g++ "Debian/Ubuntu: apt-get install -y g++"
need cmake "Debian/Ubuntu: apt-get install -y cmake, or pip install cmake"

if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv || { echo "error: '$PYTHON -m venv' failed; install the venv module (Debian/Ubuntu: apt-get install -y python3-venv)" >&2; exit 1; }
fi
# Reinstall only when the dependency list, the Horovod build recipe or the compiled part changed.
stamp=".venv/.deps-$(cat setup.cfg setup.py keras_dist/bind_address.c keras_dist/horovod_build.sh | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip setuptools wheel
  # The PyTorch release the tests run on, pinned: an unpinned one may pull a newer CUDA
  # build of several GB where a CPU build of this one is at hand.
  torch=2.13.0
  if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then tf="tf-gpu"; else tf="tf-cpu"; fi
  .venv/bin/python -m pip install -q -e ".[$tf,tfds,jax,torch,test]" "torch==$torch"
  # Horovod from the recipe keras_dist ships (keras_dist/horovod_build.sh), cached across checkouts.
  .venv/bin/keras-dist build-horovod
  rm -f .venv/.deps-*
  touch "$stamp"
fi

case "${1:-}" in
  train)
    shift
    exec .venv/bin/keras-dist launch --backend horovod -n 2 examples/train_distributed.py "$@"
    ;;
  test)
    shift
    if [ $# -gt 0 ]; then
      exec .venv/bin/python -m pytest "$@"
    fi
    # The whole suite: the multi-host tests (tests/test_hosts.py) run beside the rest, and
    # Keras's own test files, the kill-and-resume runs, the package's install, Ray Train and sharding after
    # them in the same pytest. The hosts tests mostly wait (for timeouts, on simulated hosts of one core
    # each), so side by side the suite ends sooner; which files run beside evens out the two groups' times
    # (bench/results/2026-11-27-suite-time.md).
    beside="tests/test_hosts.py tests/test_keras_suites.py tests/test_resume.py tests/test_package.py tests/test_ray.py tests/test_sharding.py"
    hosts_log=$(mktemp)
    .venv/bin/python -m pytest -p no:cacheprovider $beside > "$hosts_log" 2>&1 &
    hosts=$!
    # errexit applies inside the trap too: a kill of the already-ended pytest must not fail the run.
    trap 'kill "$hosts" 2>/dev/null || true; rm -f "$hosts_log"' EXIT
    rest=0; .venv/bin/python -m pytest $(printf -- '--ignore=%s ' $beside) || rest=$?
    hosts_status=0; wait "$hosts" || hosts_status=$?
    echo "=== $beside (ran beside the rest) ==="
    cat "$hosts_log"
    [ "$rest" -eq 0 ] && [ "$hosts_status" -eq 0 ] || { echo "pytest exit statuses: rest $rest, $beside $hosts_status" >&2; exit 1; }
    ;;
  *)
    echo "usage: ./dev.sh train|test [args]" >&2
    exit 2
    ;;
esac
