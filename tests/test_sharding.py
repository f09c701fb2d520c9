"""Sharded optimizer state (`keras_dist.compile(..., shard="optimizer")`, issue 57): each of N
processes keeps Adam's moments for about 1/N of the variables, and the job trains as the
unsharded one, and as one process at the global batch."""

import json
import re
import shutil
import time

import numpy as np
import pytest

from runner import BIN, PYTHON, WORKERS, assert_trains_like, configuration_command, rotated, run

pytestmark = pytest.mark.timeout(600)
WORKER = WORKERS / "any_backend_worker.py"
# The kill, accumulation and memory rows share the sharded optimizer's code across backends:
# a whole-suite run runs one backend each (a different one per row); this variable, all.
MATRIX = "KERAS_DIST_SHARDING_MATRIX"
LEVELS = [("torch", "optimizer"), ("torch", "weights"), ("tensorflow", "optimizer"), ("jax", "weights")]


def train(out, configuration, keras_backend, *arguments):
    out.mkdir()
    code, output = run(configuration_command(configuration, [WORKER, out, *arguments]), 300,
                       {"KERAS_BACKEND": keras_backend})
    return code, output


def results(out, processes):
    return [json.loads((out / f"result-{rank}.json").read_text()) for rank in range(processes)]


# Beyond the whole state's bytes, summed over the 2 ranks: each rank's own iteration count
# and learning rate (8 bytes) where variables have owners; and where each variable is split,
# both ranks' moments of the last bias (1 weight): JAX's, which no axis splits over 2 devices,
# and PyTorch's slices, padded to 2 of 1 weight each (16).
@pytest.mark.parametrize("keras_backend, configuration, overheads, extra", [
    # EarlyStopping reads and restores the weights in fit (split under "weights").
    ("torch", "torchrun_2", {"optimizer": 8, "weights": 16}, ["--early-stopping", "--epochs", 3]),
    # Several steps a call: the step's graph holds Horovod's operations inside a loop.
    ("tensorflow", "horovod_2", {"optimizer": 8}, ["--steps-per-execution", 3]),
    ("jax", "launch_2", {"optimizer": 16, "weights": 16}, []),
])
def test_two_processes_with_sharded_adam_train_as_one_at_the_global_batch_with_half_the_state(
        tmp_path, keras_backend, configuration, overheads, extra):
    pytest.importorskip(keras_backend)
    common = ["--adam", "--global-clipnorm", "0.5", "--samples", 64, "--epochs", 2, *extra]
    code, output = train(tmp_path / "reference", "keras_dist_1", keras_backend, "--batch", 16, *common)
    assert code == 0, output[-3000:]
    (reference,) = results(tmp_path / "reference", 1)
    code, output = train(tmp_path / "unsharded", configuration, keras_backend, "--batch", 8, "--save", "every", *common)
    assert code == 0, output[-3000:]
    unsharded = results(tmp_path / "unsharded", 2)
    for level, overhead in overheads.items():
        code, output = train(tmp_path / level, configuration, keras_backend, "--batch", 8, "--shard", level,
                             "--save", "every", *common)
        assert code == 0, output[-3000:]
        sharded = results(tmp_path / level, 2)
        for result in sharded:
            assert_trains_like(result, reference)
        # Adam's moments split over the two ranks: under "optimizer" PyTorch's and Horovod's by whole variables
        # (by bytes: the first kernel's 20 weights on rank 0, the other 9 on rank 1), JAX's each along an axis;
        # under "weights", each variable (PyTorch's in flat slices).
        whole = unsharded[0]["optimizer_state_bytes"]
        shares = [r["optimizer_state_bytes"] for r in sharded]
        assert all(share < whole for share in shares) and sum(shares) == whole + overhead, \
            (level, shares, whole)
        # Under "weights", the 29 weights too while fit runs: 15 on each rank (the last bias on both).
        held = [r["weights_bytes_in_fit"] for r in sharded]
        assert held == ([15 * 4] * 2 if level == "weights" else [29 * 4] * 2), (level, held)
        # model.save on every process, as the script calls it: one whole file, as the unsharded job's.
        code, output = run([PYTHON, "-c", LOAD_BOTH, tmp_path / level / "model.keras",
                            tmp_path / "unsharded" / "model.keras"], 120, {"KERAS_BACKEND": keras_backend})
        assert code == 0 and "same state" in output, output[-3000:]


@pytest.mark.parametrize("keras_backend, level", [*rotated(LEVELS, ("torch", "weights"), MATRIX),
                                                  ("torch", "weights-at-creation"), ("jax", "weights-at-creation")])
def test_a_sharded_job_killed_mid_epoch_ends_as_the_unsharded_job_uninterrupted(tmp_path, keras_backend, level):
    """`BackupAndRestore` every 5 steps and a `ModelCheckpoint` of the best epoch, loaded on every
    rank after fit: the chief writes the whole state, the other rank's stand-in gathers its
    share into a scratch copy; rank 1 is SIGKILLed after global step 14 (of 36, 12 an epoch), the launcher
    restarts the job, the chief restores and every rank takes its share of the restored state."""
    pytest.importorskip(keras_backend)
    resume = WORKERS / "resume.py"
    reference, killed = tmp_path / "reference", tmp_path / "killed"
    reference.mkdir()
    killed.mkdir()
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, resume, reference, "arrays", "--callback-state"], 300,
                       {"KERAS_BACKEND": keras_backend})
    assert code == 0, output[-3000:]
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, "--max-restarts", 1, resume, killed, "arrays",
                        "--callback-state", "--shard", level, "--kill-at", 14, "--kill-rank", 1], 300,
                       {"KERAS_BACKEND": keras_backend})
    assert code == 0 and (killed / "killed").exists(), output[-3000:]
    assert (killed / "steps.rerun").read_text().split("\n")[0] == "0 10", output[-3000:]  # from global step 11 of 36
    expected, resumed = np.load(reference / "result.npz"), np.load(killed / "result.npz")
    assert sorted(expected.files) == sorted(resumed.files)
    for name in expected.files:
        np.testing.assert_allclose(resumed[name], expected[name], atol=1e-5, rtol=1e-5, err_msg=name)


def test_a_sharded_backup_resumes_on_another_process_count_as_an_unsharded_job_does(tmp_path):
    """2 processes with shard="optimizer" killed after global step 14 (the backup after step
    10); the same backup then resumed on 3 processes, sharded and unsharded, ends the same:
    each of the 3 takes its share of the whole state the 2 wrote. The rest of the epoch, 16
    samples over 3 processes, ends on a step where a backup is due: written at the epoch's
    end, by every process (a worker's stand-in once waited there for the chief's copy of
    its own scratch file)."""
    resume = WORKERS / "resume.py"
    first = tmp_path / "first"
    first.mkdir()
    arguments = ["arrays", "--kill-at", 14]
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, resume, first, *arguments, "--shard", "optimizer"], 300,
                       {"KERAS_BACKEND": "torch"})
    assert code != 0 and (first / "killed").exists(), output[-3000:]
    for name, shard in (("sharded", ["--shard", "optimizer"]), ("unsharded", [])):
        shutil.copytree(first, tmp_path / name)
        code, output = run([BIN / "keras-dist", "launch", "-n", 3, resume, tmp_path / name, *arguments, *shard], 300,
                           {"KERAS_BACKEND": "torch"})
        assert code == 0 and "the backup was written by 2 processes, this run has 3" in output, output[-3000:]
    expected, resumed = np.load(tmp_path / "unsharded" / "result.npz"), np.load(tmp_path / "sharded" / "result.npz")
    assert sorted(expected.files) == sorted(resumed.files)
    for name in expected.files:
        np.testing.assert_allclose(resumed[name], expected[name], atol=1e-6, rtol=1e-6, err_msg=name)


# Caps between what each level reached unsharded and sharded (bisected by hand:
# bench/results/2026-11-27-cpu-2core-sharding.md).
CAPPED = [
    ("torch", 2200, [], {"KERAS_DIST_SHARD": "optimizer"}),  # sharded by the setting, the script unchanged
    ("jax", 1780, ["--shard", "weights"], {}),
    ("torch", 2200, ["--shard", "weights"], {}),
]


@pytest.mark.parametrize("keras_backend, cap_mib, shard_argument, shard_setting", rotated(CAPPED, CAPPED[0], MATRIX))
def test_a_model_that_does_not_fit_under_a_memory_cap_trains_sharded(tmp_path, keras_backend, cap_mib, shard_argument,
                                                                      shard_setting):
    """67M weights with Adam: unsharded, every process ends in one line naming shard='optimizer'
    (not a kill by the kernel with no output); sharded, the same job trains under the same cap."""
    pytest.importorskip(keras_backend)
    job = [BIN / "keras-dist", "launch", "-n", 2, WORKERS / "memory_cap.py", cap_mib]
    code, output = run(job, 300, {"KERAS_BACKEND": keras_backend})
    assert code != 0 and "ran out of memory in fit" in output and "shard='optimizer'" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    code, output = run([*job, *shard_argument], 300, {"KERAS_BACKEND": keras_backend, **shard_setting})
    assert code == 0 and output.count("trained 67166218") == 2, output[-3000:]


def test_a_jax_step_left_unfinished_by_a_process_short_of_memory_ends_the_job_in_one_line():
    """One process capped under what it needs: XLA's CPU client leaves a step unfinished
    instead of failing (here the uncapped rank's: the capped one's part of the all-reduce
    never came), and every process still beats. The job ends once every process waited the
    step timeout, in one line naming the rank short of memory and shard=."""
    pytest.importorskip("jax")
    timeout = 20
    started = time.monotonic()
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, WORKERS / "memory_cap.py", 1700, "--shard", "optimizer",
                        "--cap-rank", 1], 240, {"KERAS_BACKEND": "jax", "KERAS_DIST_STEP_TIMEOUT": str(timeout)})
    took = time.monotonic() - started
    lines = [line for line in output.splitlines() if "KerasDistError: the job stalled" in line]
    # The first process to end it prints the line; the launcher then stops the other.
    assert code != 0 and lines and "Traceback" not in output, output[-3000:]
    for line in lines:
        assert "for its step to finish" in line and "likely short of memory: rank 1;" in line, line
        assert "shard='weights'" in line, line
        waited = [float(w) for w in re.findall(r"waits (\d+) s", line)]
        assert waited and max(waited) <= timeout + 10, line  # a beat or two late at most
    assert took < 120, took


@pytest.mark.parametrize("keras_backend, level", rotated(LEVELS, ("tensorflow", "optimizer"), MATRIX))
def test_gradient_accumulation_and_bfloat16_train_sharded_as_unsharded(tmp_path, keras_backend, level):
    pytest.importorskip(keras_backend)
    found = {}
    for shard in ("none", level):
        code, output = run([BIN / "keras-dist", "launch", "-n", 2, WORKERS / "accumulate_bf16.py",
                            tmp_path / f"{shard}.json", shard], 300, {"KERAS_BACKEND": keras_backend})
        assert code == 0, output[-3000:]
        found[shard] = json.loads((tmp_path / f"{shard}.json").read_text())
    np.testing.assert_allclose(found[level]["loss"], found["none"]["loss"], rtol=1e-6)
    for sharded, unsharded in zip(found[level]["weights"], found["none"]["weights"]):
        np.testing.assert_allclose(sharded, unsharded, atol=1e-6)


@pytest.mark.parametrize("keras_backend, launch, modes", [
    ("torch", [], ("none", "optimizer", "weights", "created")),
    # A stand-in that saved while the chief did not waited in its gather forever (session 39).
    ("tensorflow", ["--backend", "horovod"], ("none", "optimizer")),
    ("jax", [], ("none", "optimizer", "weights", "created")),
    # Unsharded, its saves collectives: the other worker's stand-ins decide on their own.
    ("tensorflow", ["--backend", "multi_worker_mirrored"], ("none",)),
])
def test_split_weights_around_fits_as_unsharded(tmp_path, keras_backend, launch, modes):
    """shard="weights" splits only inside fit, and a model built in keras_dist.split_weights()
    for good (shard="optimizer" alongside, for its checkpoints' stand-ins): evaluate before
    any fit (shards of unequal length), a callback's model.save on every process in fit, a
    best-only checkpoint and one every third batch across fits, one through chief_only,
    freeze and compile again."""
    pytest.importorskip(keras_backend)
    found = {}
    for shard in modes:
        code, output = run([BIN / "keras-dist", "launch", *launch, "-n", 2, WORKERS / "split_weights_lifecycle.py",
                            tmp_path / f"{shard}.json", shard], 300, {"KERAS_BACKEND": keras_backend})
        assert code == 0 and "Traceback" not in output, output[-3000:]
        found[shard] = json.loads((tmp_path / f"{shard}.json").read_text())
    for shard in modes[1:]:
        np.testing.assert_allclose(found[shard]["evaluate"], found["none"]["evaluate"], rtol=1e-6, err_msg=shard)
        np.testing.assert_allclose(found[shard]["loss"], found["none"]["loss"], rtol=1e-6, err_msg=shard)
        for key in ("saved_in_fit", "best", "every-third", "chief-only", "weights"):
            assert len(found[shard][key]) == len(found["none"][key]) == 6, (shard, key)
            for split, whole in zip(found[shard][key], found["none"][key]):
                np.testing.assert_allclose(split, whole, atol=1e-6, err_msg=f"{shard} {key}")


SPLIT_AT_CREATION = WORKERS / "split_at_creation.py"
# Large freed buffers go back to the system at once: the cap counts what a process holds.
FIXED_MALLOC = {"KERAS_BACKEND": "torch", "MALLOC_MMAP_THRESHOLD_": "262144"}
# Compares .weights.h5 files pairwise in one plain process: the same datasets, equal to 1e-6.
SAME_WEIGHTS_FILES = """
import os, sys, h5py, numpy as np
def datasets(path):
    found = {}
    with h5py.File(path) as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj[()]) if isinstance(obj, h5py.Dataset) else None)
    return {name: value for name, value in found.items() if name.startswith(os.environ.get("ONLY", ""))}
least = int(sys.argv[1])  # datasets in each file
for a, b in zip(sys.argv[2::2], sys.argv[3::2]):
    x, y = datasets(a), datasets(b)
    assert sorted(x) == sorted(y) and len(x) >= least, (a, sorted(x), sorted(y))
    for name in x:
        np.testing.assert_allclose(x[name], y[name], atol=1e-6, err_msg=name)
print("same files")
"""


def test_a_model_built_split_under_a_cap_below_its_weights_trains_saves_and_loads_as_unsharded(tmp_path):
    """Issue 65: 33.6M weights (128 MiB) under a cap of 110 MiB above the imports, 4 processes.
    Built whole, the model cannot be made under the cap; built in keras_dist.split_weights(),
    it trains (a ModelCheckpoint in fit), its file equals the one an uncapped unsharded job
    writes, and it loads back. Killed (rank 1, SIGKILL after step 2 of 3) and restarted
    under the same cap, it resumes from the chief's backup, read a layer at a time, and
    ends with the same file."""
    pytest.importorskip("torch")
    capped = ["--layers", 32, "--headroom-mib", 110]
    for case, arguments in (("split", [*capped, "--checkpoint"]), ("whole_capped", [*capped, "--whole"]),
                            ("whole", ["--layers", 32, "--whole"]),
                            ("resumed", [*capped, "--backup", "--kill-rank", 1, "--kill-after-step", 2])):
        (tmp_path / case).mkdir()
        restarts = [] if case != "resumed" else ["--max-restarts", 1]
        code, output = run([BIN / "keras-dist", "launch", "-n", 4, *restarts, SPLIT_AT_CREATION, tmp_path / case,
                            *arguments], 300, FIXED_MALLOC)
        if case == "whole_capped":
            assert code != 0 and "Cannot allocate memory" in output, output[-3000:]
        else:
            assert code == 0 and output.count("trained 33597450") == 4, output[-3000:]
    assert (tmp_path / "resumed" / "killed").exists() and "fit resumes in epoch 1 after step 2" in output, output[-3000:]
    files = [tmp_path / "whole" / "model.weights.h5", tmp_path / "split" / "model.weights.h5",
             tmp_path / "split" / "model.weights.h5", tmp_path / "split" / "again.weights.h5",
             tmp_path / "split" / "model.weights.h5", tmp_path / "split" / "checkpoint.weights.h5",
             tmp_path / "whole" / "model.weights.h5", tmp_path / "resumed" / "model.weights.h5"]
    code, output = run([PYTHON, "-c", SAME_WEIGHTS_FILES, 66, *files], 120, {"KERAS_BACKEND": "torch"})
    assert code == 0 and "same files" in output, output[-3000:]


@pytest.mark.parametrize("keras_backend", ["torch", "jax"])
def test_a_model_built_split_saves_its_optimizer_state_as_unsharded(tmp_path, keras_backend):
    """model.save of a model built split writes the unsharded job's archive: weights and
    momentum gathered a layer (and a slot) at a time; its initial weights (saved before the
    optimizer is built), its ModelCheckpoint, and its weights loaded back on every process
    and saved again, the unsharded job's weights files."""
    pytest.importorskip(keras_backend)
    for case in ("split", "whole"):
        (tmp_path / case).mkdir()
        code, output = run([BIN / "keras-dist", "launch", "-n", 2, SPLIT_AT_CREATION, tmp_path / case, "--layers", 3,
                            "--width", 64, "--momentum", 0.9, "--checkpoint", *(["--whole"] if case == "whole" else [])],
                           300, {"KERAS_BACKEND": keras_backend})
        assert code == 0 and "Traceback" not in output, output[-3000:]
    code, output = run([PYTHON, "-c", LOAD_BOTH, tmp_path / "whole" / "model.keras", tmp_path / "split" / "model.keras"],
                       120, {"KERAS_BACKEND": keras_backend})
    assert code == 0 and "same state" in output, output[-3000:]
    files = [path for name in ("model", "again", "checkpoint")
             for path in (tmp_path / "whole" / "model.weights.h5", tmp_path / "split" / f"{name}.weights.h5")]
    code, output = run([PYTHON, "-c", SAME_WEIGHTS_FILES, 8, *files], 120, {"KERAS_BACKEND": keras_backend})
    assert code == 0 and "same files" in output, output[-3000:]
    # Before the first step the weights only (PyTorch builds the split model's optimizer at compile).
    initial = [tmp_path / "whole" / "initial.weights.h5", tmp_path / "split" / "initial.weights.h5"]
    code, output = run([PYTHON, "-c", SAME_WEIGHTS_FILES, 8, *initial], 120,
                       {"KERAS_BACKEND": keras_backend, "ONLY": "layers/"})
    assert code == 0 and "same files" in output, output[-3000:]


def test_a_model_built_split_compiled_with_another_level_is_one_line(tmp_path):
    pytest.importorskip("torch")
    code, output = run([BIN / "keras-dist", "launch", "-n", 2, SPLIT_AT_CREATION, tmp_path, "--layers", 2, "--width", 16,
                        "--shard", "optimizer"], 300, {"KERAS_BACKEND": "torch"})
    assert code != 0 and "KerasDistError: the model was built in keras_dist.split_weights(), so its weights stay " \
        "split: compile it with shard='weights'" in output, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


# Loads two saved models in one plain process; both must hold the same weights and optimizer state.
LOAD_BOTH = """
import sys, keras, numpy as np
a, b = (keras.models.load_model(path) for path in sys.argv[1:])
pairs = list(zip(a.weights + a.optimizer.variables, b.weights + b.optimizer.variables))
assert len(a.optimizer.variables) == len(b.optimizer.variables) > 2, (a.optimizer.variables, b.optimizer.variables)
for x, y in pairs:
    np.testing.assert_allclose(keras.ops.convert_to_numpy(x), keras.ops.convert_to_numpy(y), atol=1e-5, err_msg=x.path)
print("same state", len(pairs))
"""


@pytest.mark.parametrize("keras_backend, case, arguments, error, processes", [
    ("torch", "chief_alone_saves", ["--adam", "--save", "chief"],
     "model.save gathers every process's share of the optimizer's state, but rank 1 on ", 1),
    ("torch", "weights_clipnorm", ["--shard", "weights", "--clipnorm", "1.0"],
     "shard='weights' does not take clipnorm yet", 2),
    ("tensorflow", "weights", ["--shard", "weights"], "backend 'horovod' cannot shard the weights yet", 2),
    # Horovod's examples give the chief alone its checkpoints: its gathers would wait for the others.
    ("torch", "chief_alone_checkpoints", ["--callbacks", "chief"],
     "rank 0 passes fit ['ModelCheckpoint', 'BackupAndRestore'] and rank 1 passes none: where every process takes part", 2),
    ("tensorflow", "chief_alone_saves", ["--adam", "--save", "chief"],
     "model.save gathers every process's share of the optimizer's state, but rank 1 on ", 1),
    # JAX's gather would wait for rank 1 forever: it ended cleanly.
    ("jax", "chief_alone_saves", ["--adam", "--save", "chief"],
     "model.save gathers every process's share of the optimizer's state, but rank 1 on ", 1),
])
def test_what_sharded_state_cannot_do_is_one_line(tmp_path, keras_backend, case, arguments, error, processes):
    pytest.importorskip(keras_backend)
    shard = [] if "--shard" in arguments else ["--shard", "optimizer"]
    code, output = train(tmp_path / case, "launch_2", keras_backend, *shard, *arguments)
    # Every process that gets there says it (at compile, one may be stopped first, once another ended).
    assert code != 0 and 1 <= output.count(f"KerasDistError: {error}") <= processes, output[-3000:]
    assert "Traceback" not in output, output[-3000:]


def test_a_backend_that_cannot_shard_says_so_in_one_line(tmp_path):
    code, output = train(tmp_path / "tensorflow", "mwms_2", "tensorflow", "--shard", "optimizer")
    assert code != 0 and "backend 'multi_worker_mirrored' cannot shard the optimizer's state" in output, \
        output[-3000:]
    assert "Traceback" not in output, output[-3000:]
