#!/usr/bin/env bash
# Builds a Horovod wheel from its PyPI sdist against the TensorFlow installed in the
# current Python, caches it under ~/.cache/keras_dist/wheels (or $KERAS_DIST_CACHE), and
# installs it. Later runs, from any environment, reuse the cached wheel.
#
# Run it as `keras-dist build-horovod`, which ships this file in the wheel, runs it with
# its own interpreter as PYTHON, and first says in one line what is missing of gcc, g++,
# cmake and TensorFlow.
#
# Why a build of our own: Horovod 0.28.1 (its last release) does not compile against
# TF >= 2.19, because horovod/tensorflow/xla_mpi_ops.cc includes XLA headers that moved.
# Those XLA ops are optional (HOROVOD_ENABLE_XLA_OPS, off by default) and GPU-only, so we
# compile that file's body only for GPU builds on TF < 2.19. Everything else is stock.
#
# Where PyTorch is installed too, Horovod's torch operations are built as well (the `torch`
# backend uses them under horovodrun); two fixes make 0.28.1 build against torch >= 2.1:
# its torch extension asks for C++14 where torch's (and TensorFlow's) headers need C++17,
# and under C++17 Gloo's `Store::kDefaultTimeout` is defined in two objects with the same
# value, which the linker is told to accept.
#
# One fix for jobs across machines: Gloo contexts of process sets (the global set's too)
# ignore HOROVOD_GLOO_IFACE and advertise whatever the host name resolves to, 127.0.1.1
# on Debian and Ubuntu, so ranks on other machines fail to connect; they take the global
# context's interface instead.
#
# One fix for speed: Gloo is built with its vectorised float16 sum (GLOO_USE_AVX; Horovod
# compiles everything with -mavx -mf16c already). Without it Gloo adds half floats one at a
# time in software: gradient_compression="fp16" then cost more CPU than it saved on the wire
# (figures: bench/results/2026-11-25-figures-from-comments.md).
# PATCH_LEVEL names our patches in the cached wheel's path.
#
# MPI only where it works: Open MPI's runtime alone (Debian's openmpi-bin) brings mpicxx
# without mpi.h, and Horovod's cmake then fails after a minute and a half. A small MPI program
# compiled with mpicxx decides; otherwise Horovod is built with Gloo (horovodrun and
# `keras-dist launch` run it; mpirun does not), said in one line. `--mpi-check` prints the
# choice and exits.
#
# Env: PYTHON (default: python), HOROVOD_VERSION (default 0.28.1).
# GPU: when nvcc and NCCL are found, the build uses NCCL for all-reduce (HOROVOD_GPU_OPERATIONS=NCCL).
set -euo pipefail
PYTHON=${PYTHON:-python}
version=${HOROVOD_VERSION:-0.28.1}

mpi_choice() {  # prints "mpi", or "gloo: why not MPI"
  local compiler probe status=0
  compiler=$(command -v mpicxx) || { echo "gloo: no MPI compiler (mpicxx) on PATH"; return; }
  probe=$(mktemp -d)
  printf '#include <mpi.h>\nint main(int argc, char **argv) { MPI_Init(&argc, &argv); return MPI_Finalize(); }\n' >"$probe/probe.cc"
  "$compiler" "$probe/probe.cc" -o "$probe/probe" >"$probe/log" 2>&1 || status=$?
  if [ "$status" -eq 0 ]; then
    echo mpi
  else
    echo "gloo: $compiler cannot build an MPI program ($(grep -m1 -i 'error' "$probe/log" | sed 's/^[^ ]* //' || true)); for MPI install its headers (Debian/Ubuntu: apt-get install -y libopenmpi-dev) and build again"
  fi
  rm -rf "$probe"
}
mpi=$(mpi_choice)
if [ "${1:-}" = --mpi-check ]; then
  echo "$mpi"
  exit 0
fi

tf_version=$("$PYTHON" -c 'import tensorflow as tf; print(tf.__version__)' 2>/dev/null) \
  || { echo "error: TensorFlow is not importable by $PYTHON; install tensorflow (or tensorflow-cpu) first" >&2; exit 1; }
gpu=cpu
if command -v nvcc >/dev/null && "$PYTHON" -c 'import tensorflow as tf, sys; sys.exit(not tf.test.is_built_with_cuda())'; then
  gpu=cuda
fi

torch_version=$("$PYTHON" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null) || torch_version=""

PATCH_LEVEL=2
cache_root="${KERAS_DIST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/keras_dist}"
mpi_tag=""  # wheels built without MPI keep the names they had before MPI was probed
[ "$mpi" = mpi ] && mpi_tag="-mpi"
cache="$cache_root/wheels/horovod-$version-tf$tf_version${torch_version:+-torch$torch_version}-$gpu$mpi_tag-p$PATCH_LEVEL"
if ! ls "$cache"/horovod-*.whl >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  "$PYTHON" -m pip download -q --no-deps --no-binary :all: "horovod==$version" -d "$work"
  tar -xzf "$work"/horovod-"$version".tar.gz -C "$work"
  src="$work/horovod-$version"
  # The XLA custom-call ops: only for GPU builds on TF < 2.19 (see header comment).
  sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/#if TENSORFLOW_VERSION >= 2006000000 \&\& TENSORFLOW_VERSION < 2019000000 \&\& HAVE_GPU/' \
    "$src/horovod/tensorflow/xla_mpi_ops.cc"
  grep -q 'TENSORFLOW_VERSION < 2019000000 && HAVE_GPU' "$src/horovod/tensorflow/xla_mpi_ops.cc" \
    || { echo "error: Horovod $version sources changed; update keras_dist/horovod_build.sh" >&2; exit 1; }
  # Process sets' Gloo contexts on the global context's interface (see header comment).
  sed -i 's/^  assert(global_context.IsEnabled());$/&\n  gloo_iface_ = global_context.gloo_iface_;/' "$src/horovod/common/gloo/gloo_context.cc"
  grep -q '^  gloo_iface_ = global_context.gloo_iface_;$' "$src/horovod/common/gloo/gloo_context.cc" \
    || { echo "error: Horovod $version sources changed; update keras_dist/horovod_build.sh" >&2; exit 1; }
  # Gloo's float16 sum with F16C instructions (see header comment).
  # gloo/math.h tests GLOO_USE_AVX without including the header that defines it, so the
  # definition goes on every compile line, Horovod's own files included; the vectorised
  # sums live in gloo/math.cc, which Horovod's copy of Gloo leaves out of its build.
  sed -i 's/^    set(CMAKE_POLICY_DEFAULT_CMP0074 NEW)$/    set(USE_AVX ON CACHE BOOL "Gloo float16 sums with F16C" FORCE)\n    add_definitions(-DGLOO_USE_AVX=1)\n&/' "$src/CMakeLists.txt"
  sed -i 's|^  "${CMAKE_CURRENT_SOURCE_DIR}/types.cc"$|&\n  "${CMAKE_CURRENT_SOURCE_DIR}/math.cc"|' "$src/third_party/gloo/gloo/CMakeLists.txt"
  { grep -q 'add_definitions(-DGLOO_USE_AVX=1)' "$src/CMakeLists.txt" && grep -q '/math.cc"' "$src/third_party/gloo/gloo/CMakeLists.txt"; } \
    || { echo "error: Horovod $version sources changed; update keras_dist/horovod_build.sh" >&2; exit 1; }
  # A release build without debug info: same -O3 code, about a fifth less build time.
  sed -i "s/else 'RelWithDebInfo'$/else 'Release'/" "$src/setup.py"
  grep -q "else 'Release'$" "$src/setup.py" || { echo "error: Horovod $version sources changed; update keras_dist/horovod_build.sh" >&2; exit 1; }
  export HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MXNET=1
  if [ -n "$torch_version" ]; then
    export HOROVOD_WITH_PYTORCH=1 LDFLAGS="${LDFLAGS:-} -Wl,--allow-multiple-definition"
    sed -i 's/^    set(CMAKE_CXX_STANDARD 14)$/    set(CMAKE_CXX_STANDARD 17)/' "$src/horovod/torch/CMakeLists.txt"
    grep -q 'CMAKE_CXX_STANDARD 17' "$src/horovod/torch/CMakeLists.txt" \
      || { echo "error: Horovod $version sources changed; update keras_dist/horovod_build.sh" >&2; exit 1; }
  else
    export HOROVOD_WITHOUT_PYTORCH=1
  fi
  if [ "$mpi" != mpi ]; then
    export HOROVOD_WITHOUT_MPI=1
    command -v mpicxx >/dev/null && echo "keras_dist: building Horovod with Gloo only, ${mpi#gloo: }" >&2
  fi
  [ "$gpu" = cuda ] && export HOROVOD_GPU_OPERATIONS=NCCL
  export MAKEFLAGS="-j$(nproc)"
  echo "building Horovod $version against TensorFlow $tf_version${torch_version:+ and PyTorch $torch_version} ($gpu); this takes a few minutes once" >&2
  "$PYTHON" -m pip install -q packaging cloudpickle psutil pyyaml >/dev/null
  # The build's output goes to a log kept beside the cache: a failure is one line naming its
  # first error and the log, not pip's traceback.
  mkdir -p "$cache_root"
  log="$cache_root/horovod-build.log"
  if ! "$PYTHON" -m pip wheel -q --no-build-isolation --no-deps -w "$work/dist" "$src" >"$log" 2>&1; then
    cause=$(grep -m1 -E 'CMake Error|error:|Error:' "$log" | sed 's/^ *//' | cut -c1-200 || true)
    echo "error: Horovod's build failed: ${cause:-see the log}; full log: $log" >&2
    exit 1
  fi
  mkdir -p "$cache"
  cp "$work"/dist/horovod-*.whl "$cache"/
fi
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$cache"/horovod-*.whl
"$PYTHON" -m pip install -q cloudpickle psutil pyyaml packaging >/dev/null
TF_CPP_MIN_LOG_LEVEL=2 "$PYTHON" -c "import horovod.tensorflow${torch_version:+, horovod.torch}" \
  || { echo "error: the Horovod wheel does not import; delete $cache and rerun" >&2; exit 1; }
