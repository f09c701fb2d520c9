"""The examples: the two-line change, the main job of docs/backends.md, training from TFDS, ResNet-50 on ImageNet."""

import ast
import difflib
import re

import pytest

from runner import BIN, PYTHON, ROOT, run

EXAMPLES = ROOT / "examples"


def code_lines(path):
    """Source lines without the module docstring (which says how to run each file)."""
    source = path.read_text()
    docstring = ast.get_docstring(ast.parse(source), clean=False)
    if docstring:
        source = source.replace(docstring, "", 1)
    return source.splitlines()


def test_distributed_example_is_the_single_device_one_with_two_lines_changed():
    single, distributed = code_lines(EXAMPLES / "train.py"), code_lines(EXAMPLES / "train_distributed.py")
    changed = [line for line in difflib.unified_diff(single, distributed, lineterm="", n=0)
               if line.startswith("+") and not line.startswith("+++")]
    assert changed == ["+import keras_dist", "+keras_dist.compile(model,"]
    assert len(distributed) == len(single) + 1  # one line added, one line changed


def test_main_job_trains_with_two_horovod_processes(tmp_path):
    # As a user runs it: with no TF_CPP_MIN_LOG_LEVEL of the suite's.
    code, out = run(["env", "-u", "TF_CPP_MIN_LOG_LEVEL", BIN / "keras-dist", "launch", "--backend", "horovod", "-n", 2,
                     EXAMPLES / "train_distributed.py"], timeout=300, env={"EPOCHS": "2", "OUTPUT": str(tmp_path)})
    assert code == 0, out[-4000:]
    # Before the first epoch: keras_dist's one summary line, none of TensorFlow's start-up lines.
    start = out.split("[rank:0] Epoch 1/2", 1)[0].splitlines()
    assert start == ["[rank:0] keras_dist: horovod backend (HorovodStrategy): 2 replicas in 2 processes on 1 machine "
                     "(cluster environment: mpi)"], start
    assert "[rank:0] Epoch 2/2" in out
    assert "[rank:1] Epoch" not in out  # progress on rank 0 only
    accuracies = [float(a) for a in re.findall(r"\[rank:\d\] test accuracy: ([0-9.]+)", out)]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert accuracies[0] > 0.6  # 10 classes: chance is 0.1
    assert (tmp_path / "best.keras").is_file() and (tmp_path / "log.csv").is_file()


def test_keras_dist_log_debug_shows_every_process_and_every_start_up_line(tmp_path):
    pytest.importorskip("jax")
    script = tmp_path / "train.py"
    script.write_text("import keras, numpy as np\nimport keras_dist\n"
                      "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
                      "keras_dist.compile(model, optimizer='sgd', loss='mse')\n"
                      "model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)\n")
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, script], timeout=180,
                    env={"KERAS_BACKEND": "jax", "KERAS_DIST_LOG": "debug"})
    assert code == 0, out[-4000:]
    for rank in range(2):
        assert f"[rank:{rank}] keras_dist: this process is {{'backend': 'jax', 'rank': {rank}" in out, out[-4000:]
        assert f"[rank:{rank}] [Gloo] Rank {rank} is connected" in out, out[-4000:]  # dropped unless debugging


def checksum(out, prefix=""):
    found = re.findall(re.escape(prefix) + r"test accuracy: ([0-9.]+).*weights checksum: ([0-9.]+)", out)
    assert found, out[-4000:]
    return [tuple(float(v) for v in match) for match in found]


def prepare_tfds_dataset(module, data_dir):
    """Runs `prepare(data_dir)` of an examples/ module that writes a dataset in TFDS's format."""
    script = f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import {module}; {module}.prepare({str(data_dir)!r})"
    code, out = run([PYTHON, "-c", script], timeout=180)
    assert code == 0, out[-4000:]


def test_tfds_dataset_built_locally_trains_two_ranks_like_one_process_at_double_batch(tmp_path):
    data_dir = tmp_path / "tfds"
    prepare_tfds_dataset("synthetic_tfds", data_dir)
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, EXAMPLES / "tfds_classifier.py", data_dir],
                    timeout=300, env={"EPOCHS": "1", "BATCH_SIZE": "16"})
    assert code == 0, out[-4000:]
    two_ranks = checksum(out, "] ")
    code, out = run([PYTHON, EXAMPLES / "tfds_classifier.py", data_dir], timeout=300,
                    env={"EPOCHS": "1", "BATCH_SIZE": "32"})
    assert code == 0, out[-4000:]
    (single,) = checksum(out)
    assert len(two_ranks) == 2 and two_ranks[0] == two_ranks[1]
    assert two_ranks[0][0] == pytest.approx(single[0], abs=2e-3)
    assert two_ranks[0][1] == pytest.approx(single[1], rel=1e-5)
    assert single[0] > 0.5


RESNET = EXAMPLES / "resnet50_imagenet.py"
# The smallest images ResNet-50 takes, and few steps: building and tracing the model dominate anyway.
TINY_RESNET_RUN = ["--image-size", 32, "--batch-size", 4, "--epochs", 2, "--steps-per-epoch", 2,
                   "--validation-steps", 1]
COMPUTE_DTYPES = {"float32": "float32", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def event_files(output_dir, subdir):
    return list((output_dir / "tensorboard" / subdir).glob("events.out.tfevents.*"))


def test_resnet50_example_resumes_after_preemption_with_two_horovod_processes(tmp_path):
    """One test for the whole job and its resumption: each 2-process ResNet-50 run takes about a minute."""
    launch = [BIN / "keras-dist", "launch", "--backend", "horovod", "-n", 2, RESNET, *TINY_RESNET_RUN,
              "--output-dir", tmp_path]
    code, out = run([*launch, "--exit-after-epochs", 1], timeout=240)
    assert code != 0, out[-4000:]  # the chief was killed
    assert "[rank:0] Epoch 1/2" in out and "Epoch 2/2" not in out, out[-4000:]
    assert (tmp_path / "backup").is_dir()
    assert len(event_files(tmp_path, "train")) == 1  # the chief's only

    code, out = run(launch, timeout=240)
    assert code == 0, out[-4000:]
    assert "[rank:0] Epoch 2/2" in out and "Epoch 1/2" not in out, out[-4000:]
    assert "[rank:1] Epoch" not in out  # progress on the chief only
    finished = re.findall(r"\[rank:(\d)\] epochs run: ([\d ]+?)  final loss: ([0-9.]+)", out)
    assert sorted(rank for rank, _, _ in finished) == ["0", "1"], out[-4000:]
    assert {(epochs, loss) for _, epochs, loss in finished} == {("2", finished[0][2])}  # global logs: same on both
    policies = re.findall(r"precision policy: (\w+), compute dtype: (\w+),", out)
    assert len(policies) == 2 and all(COMPUTE_DTYPES[policy] == dtype for policy, dtype in policies)
    assert (tmp_path / "best.keras").is_file()
    assert not (tmp_path / "backup").exists()  # removed once training completes
    # One events file per run: the chief's.
    assert len(event_files(tmp_path, "train")) == 2 and len(event_files(tmp_path, "validation")) == 2


def test_resnet50_example_reads_imagenet_from_tfds_in_mixed_bfloat16(tmp_path):
    data_dir = tmp_path / "tfds"
    prepare_tfds_dataset("tiny_imagenet_tfds", data_dir)
    # Default steps: 8 training images at a global batch of 2 x 2 make 2 steps; each process
    # validates on its half of the 4 validation images.
    code, out = run([BIN / "keras-dist", "launch", "--backend", "horovod", "-n", 2, RESNET, "--data-dir", data_dir,
                     "--precision", "mixed_bfloat16", "--image-size", 32, "--batch-size", 2, "--epochs", 1,
                     "--output-dir", tmp_path / "run"], timeout=240)
    assert code == 0, out[-4000:]
    assert out.count("precision policy: mixed_bfloat16, compute dtype: bfloat16, variable dtype: float32") == 2
    assert "[rank:0] 2/2 - " in out, out[-4000:]
    losses = re.findall(r"\] epochs run: 1  final loss: ([0-9.]+)", out)
    assert len(losses) == 2 and losses[0] == losses[1], out[-4000:]


@pytest.mark.parametrize("keras_backend, options, reporters", [
    ("tensorflow", ["--backend", "multi_worker_mirrored"], ["worker:0", "worker:1"]),
    ("tensorflow", ["--backend", "parameter_server", "--ps", 1], ["chief:0"]),  # workers and ps only serve
    ("jax", [], ["rank:0", "rank:1"]),  # launch's default under KERAS_BACKEND=jax: the jax backend
    ("torch", [], ["rank:0", "rank:1"]),
])
def test_two_line_example_launches_under_keras_dist_launch(tmp_path, keras_backend, options, reporters):
    pytest.importorskip(keras_backend)
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, *options, EXAMPLES / "train_distributed.py"], timeout=400,
                    env={"EPOCHS": "2", "OUTPUT": str(tmp_path), "KERAS_BACKEND": keras_backend})
    assert code == 0, out[-4000:]
    accuracies = dict(re.findall(r"\[([a-z]+:\d)\] test accuracy: ([0-9.]+)", out))
    assert sorted(accuracies) == reporters, out[-3000:]
    assert len(set(accuracies.values())) == 1  # the same global result on every reporting task
    assert float(accuracies[reporters[0]]) > 0.6  # 10 classes: chance is 0.1
    assert (tmp_path / "best.keras").is_file() and len((tmp_path / "log.csv").read_text().splitlines()) == 3


def test_a_jax_process_started_alone_on_a_host_with_several_devices_trains_on_all(tmp_path):
    # XLA's forced host devices stand in for a Cloud TPU VM's chips (issue 54): no launcher,
    # the two-line example: 7373 training samples at 64 per replica on 4 replicas, 29 steps an epoch.
    pytest.importorskip("jax")
    code, out = run([PYTHON, EXAMPLES / "train_distributed.py"], timeout=400,
                    env={"EPOCHS": "1", "OUTPUT": str(tmp_path), "KERAS_BACKEND": "jax",
                         "XLA_FLAGS": "--xla_force_host_platform_device_count=4"})
    assert code == 0, out[-4000:]
    assert "jax backend (JaxDataParallelStrategy): 4 replicas in 1 process on 1 machine" in out, out[-3000:]
    assert re.search(r"^29/29 ", out, re.MULTILINE), out[-3000:]
