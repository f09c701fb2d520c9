"""Keras on JAX and on PyTorch: real processes on 127.0.0.1, joined by JAX's process group
or by torch.distributed (gloo both), against one process at the global batch."""

import os

import numpy as np
import pytest

from runner import BIN, PYTHON, WORKERS, assert_trains_like, horovodrun, load, run

pytestmark = pytest.mark.timeout(600)
WORKER = WORKERS / "any_backend_worker.py"
# Keras backend -> the keras_dist backend that distributes it, and the package it needs.
KERAS_BACKENDS = {"jax": "jax", "torch": "torch"}


@pytest.fixture(params=sorted(KERAS_BACKENDS))
def keras_backend(request):
    pytest.importorskip(request.param)  # installed by ./dev.sh (the `jax` and `torch` extras)
    return request.param


def launch(keras_backend, out_dir, *args, processes=2, timeout=300):
    """`keras-dist launch` (its default backend for this Keras backend) of the worker; (code, output)."""
    os.makedirs(out_dir, exist_ok=True)
    return run([BIN / "keras-dist", "launch", "-n", processes, WORKER, out_dir, *args], timeout=timeout,
               env={"KERAS_BACKEND": keras_backend})


def single(keras_backend, out_dir, *args):
    os.makedirs(out_dir, exist_ok=True)
    code, out = run([PYTHON, WORKER, out_dir, *args], timeout=300, env={"KERAS_BACKEND": keras_backend})
    assert code == 0, out[-3000:]
    return load(out_dir, 0)


def test_two_processes_match_one_at_twice_the_batch_and_only_the_chief_writes(tmp_path, keras_backend):
    # 17 evaluation samples: shards of 9 and 8, inside fit (validation) and after it.
    reference = single(keras_backend, tmp_path / "single", "--batch", 16, "--adam")
    out_dir = tmp_path / "distributed"
    code, out = launch(keras_backend, out_dir, "--batch", 8, "--adam", "--callbacks")
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(out_dir, rank)
        assert result["describe"]["backend"] == KERAS_BACKENDS[keras_backend]
        assert result["describe"]["num_replicas"] == 2
        assert result["imported_by_keras_dist"] == []  # neither TensorFlow nor Horovod
        assert len(result["predict"]) == 17  # the whole prediction, in input order, on every process
        assert_trains_like(result, reference)
        if keras_backend == "torch":  # gradients all-reduced while backward ran, not after it
            assert result["describe"]["buckets_started_in_backward"] > 0
    # Checkpoint and CSV log from the chief alone; the backup is removed when fit ends.
    assert sorted(os.listdir(out_dir)) == ["ckpt.weights.h5", "log.csv", "result-0.json", "result-1.json"]


def test_a_tf_data_pipeline_is_split_as_on_tensorflow(tmp_path, keras_backend):
    # Seeded shuffle, map, batch: each process maps its interleaved share in one process's order.
    reference = single(keras_backend, tmp_path / "single", "--batch", 16, "--dataset")
    code, out = launch(keras_backend, tmp_path / "distributed", "--batch", 8, "--dataset")
    assert code == 0, out[-4000:]
    for rank in range(2):
        assert_trains_like(load(tmp_path / "distributed", rank), reference)


def test_a_pydataset_is_split_by_batch(tmp_path, keras_backend):
    # fit, validation, evaluate and predict on PyDatasets of batches of B: at each step the
    # processes take consecutive batches, which one process at 2B reads as one (17 samples:
    # the last step of evaluation gives one process an empty batch).
    reference = single(keras_backend, tmp_path / "single", "--batch", 16, "--pydataset")
    code, out = launch(keras_backend, tmp_path / "distributed", "--batch", 8, "--pydataset")
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(tmp_path / "distributed", rank)
        assert len(result["predict"]) == 17
        assert_trains_like(result, reference)


def test_compiling_again_after_freezing_a_layer(tmp_path, keras_backend):
    reference = single(keras_backend, tmp_path / "single", "--batch", 16, "--adam", "--recompile")
    code, out = launch(keras_backend, tmp_path / "distributed", "--batch", 8, "--adam", "--recompile")
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(tmp_path / "distributed", rank)
        assert "recompiled_loss" in result["history"]
        assert_trains_like(result, reference)


def test_import_and_detection_need_no_tensorflow(keras_backend):
    script = ("import sys, keras_dist\n"
              "from keras_dist.runtime import Runtime, get\n"
              "print(Runtime.from_environ({'RANK': '1', 'WORLD_SIZE': '2', 'MASTER_ADDR': 'h', 'MASTER_PORT': '1'}).backend,"
              " get().backend, sorted(m for m in ('tensorflow', 'horovod') if m in sys.modules))\n")
    code, out = run([PYTHON, "-c", script], timeout=120, env={"KERAS_BACKEND": keras_backend})
    assert code == 0 and out.strip().splitlines()[-1] == f"{KERAS_BACKENDS[keras_backend]} single []", out[-2000:]


def test_a_tensorflow_backend_under_another_keras_backend_is_a_one_line_error(keras_backend):
    code, out = run([PYTHON, "-c", "import keras_dist"], timeout=120,
                    env={"KERAS_BACKEND": keras_backend, "KERAS_DIST_BACKEND": "horovod"})
    assert code != 0
    assert (f"KerasDistError: backend 'horovod' trains Keras on tensorflow, but Keras runs on {keras_backend}; "
            "set KERAS_BACKEND=tensorflow or choose another backend") in out


def test_a_launcher_without_a_coordinator_is_a_one_line_error(keras_backend):
    # mpirun-style variables name no address for the process group.
    env = {"KERAS_BACKEND": keras_backend, "OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"}
    code, out = run([PYTHON, "-c", "import keras_dist; keras_dist.init()"], timeout=120, env=env)
    assert code != 0 and "launcher names no coordinator for" in out, out[-2000:]


def test_horovodrun_runs_the_script_unchanged(tmp_path, keras_backend):
    # PyTorch: Horovod's own torch operations (./dev.sh builds Horovod for PyTorch too).
    # JAX: horovodrun names no address for its process group; rank 0 publishes one in
    # horovodrun's rendezvous store, where rank 1 reads it.
    reference = single(keras_backend, tmp_path / "single", "--batch", 16)
    out_dir = tmp_path / "horovodrun"
    os.makedirs(out_dir)
    code, out = horovodrun(2, [WORKER, out_dir, "--batch", 8], timeout=300, env={"KERAS_BACKEND": keras_backend})
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(out_dir, rank)
        assert result["describe"]["backend"] == KERAS_BACKENDS[keras_backend]
        if keras_backend == "torch":
            assert result["describe"]["collectives"] == "horovod"
            assert result["describe"]["buckets_started_in_backward"] > 0  # overlapped with backward, as on gloo
        assert "tensorflow" not in result["imported_by_keras_dist"]
        assert_trains_like(result, reference)


def test_torchrun_launches_the_same_training(tmp_path):
    pytest.importorskip("torch")
    reference = single("torch", tmp_path / "single", "--batch", 16)
    out_dir = tmp_path / "torchrun"
    os.makedirs(out_dir)
    code, out = run([PYTHON, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", 2, WORKER, out_dir,
                     "--batch", 8], timeout=300, env={"KERAS_BACKEND": "torch"})
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(out_dir, rank)
        assert result["describe"]["backend"] == "torch"
        assert_trains_like(result, reference)


@pytest.mark.parametrize("launcher", ["keras-dist", "horovodrun"])
def test_pytorch_two_backward_passes_per_step_with_an_optimizer_each(tmp_path, launcher):
    # A GAN-shaped custom train_step: each backward yields gradients for both layers, and
    # one optimizer updates one layer after it. Gradient hooks start buckets for both.
    # Under horovodrun (Horovod's torch operations) their collectives' names must not clash.
    pytest.importorskip("torch")
    reference = single("torch", tmp_path / "single", "--batch", 16, "--adam", "--two-optimizers")
    args = ["--batch", 8, "--adam", "--two-optimizers"]
    if launcher == "horovodrun":
        os.makedirs(tmp_path / "distributed")
        code, out = horovodrun(2, [WORKER, tmp_path / "distributed", *args], timeout=300, env={"KERAS_BACKEND": "torch"})
    else:
        code, out = launch("torch", tmp_path / "distributed", *args)
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(tmp_path / "distributed", rank)
        assert result["describe"]["buckets_started_in_backward"] > 0
        assert_trains_like(result, reference)


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_pytorch_compression_stays_close_and_in_sync(tmp_path, compression):
    # Buckets travel in 16 bits (cast in the copy into the bucket) and come back averaged.
    pytest.importorskip("torch")
    reference = single("torch", tmp_path / "single", "--batch", 16)
    code, out = launch("torch", tmp_path / "distributed", "--batch", 8, "--compression", compression)
    assert code == 0, out[-4000:]
    ranks = [load(tmp_path / "distributed", rank) for rank in range(2)]
    assert ranks[0]["weights"] == ranks[1]["weights"]
    assert ranks[0]["describe"]["buckets_started_in_backward"] > 0
    difference = max(float(np.max(np.abs(np.array(a) - np.array(b))))
                     for a, b in zip(ranks[0]["weights"], reference["weights"]))
    print(f"{compression}: {difference:.2e} from one process")
    assert 0 < difference < 1e-2  # rounded, not skipped


def test_pytorch_process_group_is_destroyed_before_python_shuts_down(tmp_path):
    # Left to interpreter shutdown, gloo's threads aborted about one run in four after the
    # script had ended well ("terminate called without an active exception"). A handler
    # registered before `import keras_dist` runs after keras_dist's own (atexit is LIFO).
    pytest.importorskip("torch")
    script = tmp_path / "exit_check.py"
    script.write_text("import atexit\n"
                      "import torch.distributed as dist\n"
                      "atexit.register(lambda: print('still initialized at exit:', dist.is_initialized(), flush=True))\n"
                      "import keras_dist\n"
                      "keras_dist.init()\n")
    code, out = run([BIN / "keras-dist", "launch", "--backend", "torch", "-n", 2, script], timeout=120,
                    env={"KERAS_BACKEND": "torch"})
    assert code == 0, out[-3000:]
    assert out.count("still initialized at exit: False") == 2, out[-3000:]


def test_a_torch_step_all_reduces_each_gradient_once(tmp_path):
    """Counted from torch's profiler in a real 2-process step: every gradient element is
    all-reduced once (in buckets), and Keras 3.16's own DDP wrapping and per-step metric
    all-reduce stay off (keras_dist/keras_workarounds_torch.py; issue 41)."""
    pytest.importorskip("torch")
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, WORKERS / "collectives_per_step.py", tmp_path], timeout=300,
                    env={"KERAS_BACKEND": "torch"})
    assert code == 0, out[-4000:]
    for rank in range(2):
        result = load(tmp_path, rank)
        assert not result["keras_wrapped_ddp"]
        assert len(result["reduced_per_step"]) >= 6 and set(result["reduced_per_step"]) == {result["parameters"]}, result


COMPILES_PER_FIT = """
import sys, keras, numpy as np, jax
if sys.argv[1] == "keras_dist":
    import keras_dist
else:  # plain Keras under its own DataParallel
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
compile = model.compile if sys.argv[1] != "keras_dist" else lambda **kw: keras_dist.compile(model, **kw)
compile(optimizer="sgd", loss="mse", metrics=["mae"])
model.fit(np.zeros((32, 4)), np.zeros((32, 2)), batch_size=8, epochs=3, verbose=0)
"""


@pytest.mark.parametrize("mode", ["plain", "keras_dist"])
def test_jax_compiles_the_train_step_once_per_fit(tmp_path, mode):
    """Canary and fix (keras_dist/keras_workarounds_jax.py): under a distribution plain
    Keras's metric resets put the metric states on one device, and its train step is
    compiled again in a fit (2 or 3 times); keras_dist's JAX strategy keeps them replicated: once."""
    pytest.importorskip("jax")
    script = tmp_path / "fit.py"
    script.write_text(COMPILES_PER_FIT)
    code, out = run([PYTHON, script, mode], timeout=120, env={"KERAS_BACKEND": "jax", "JAX_LOG_COMPILES": "1",
                                                              "KERAS_DIST_BACKEND": "jax" if mode == "keras_dist" else ""})
    assert code == 0, out[-3000:]
    compiles = out.count("Finished XLA compilation of jit(train_step)")
    assert compiles > 1 if mode == "plain" else compiles == 1, out[-3000:]
