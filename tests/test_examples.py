"""The examples: the two-line change, the README's main job, and training from TFDS."""

import ast
import difflib
import re

import pytest

from conftest import BIN, PYTHON, ROOT, run

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
    code, out = run([BIN / "keras-dist", "launch", "--backend", "horovod", "-n", 2, EXAMPLES / "train_distributed.py"],
                    timeout=300, env={"EPOCHS": "2", "OUTPUT": str(tmp_path)})
    assert code == 0, out[-4000:]
    assert "[0]<stdout>:Epoch 2/2" in out
    assert "[1]<stdout>:Epoch" not in out  # progress on rank 0 only
    accuracies = [float(a) for a in re.findall(r"\[\d\]<stdout>:test accuracy: ([0-9.]+)", out)]
    assert len(accuracies) == 2 and accuracies[0] == accuracies[1]
    assert accuracies[0] > 0.6  # 10 classes: chance is 0.1
    assert (tmp_path / "best.keras").is_file() and (tmp_path / "log.csv").is_file()


def checksum(out, prefix=""):
    found = re.findall(re.escape(prefix) + r"test accuracy: ([0-9.]+).*weights checksum: ([0-9.]+)", out)
    assert found, out[-4000:]
    return [tuple(float(v) for v in match) for match in found]


def test_tfds_dataset_built_locally_trains_two_ranks_like_one_process_at_double_batch(tmp_path):
    data_dir = tmp_path / "tfds"
    code, out = run([PYTHON, "-c", f"import sys; sys.path.insert(0, {str(EXAMPLES)!r}); import synthetic_tfds; "
                     f"synthetic_tfds.prepare({str(data_dir)!r})"], timeout=180)
    assert code == 0, out[-4000:]
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, EXAMPLES / "tfds_classifier.py", data_dir],
                    timeout=300, env={"EPOCHS": "1", "BATCH_SIZE": "16"})
    assert code == 0, out[-4000:]
    two_ranks = checksum(out, "<stdout>:")
    code, out = run([PYTHON, EXAMPLES / "tfds_classifier.py", data_dir], timeout=300,
                    env={"EPOCHS": "1", "BATCH_SIZE": "32"})
    assert code == 0, out[-4000:]
    (single,) = checksum(out)
    assert len(two_ranks) == 2 and two_ranks[0] == two_ranks[1]
    assert two_ranks[0][0] == pytest.approx(single[0], abs=2e-3)
    assert two_ranks[0][1] == pytest.approx(single[1], rel=1e-5)
    assert single[0] > 0.5
