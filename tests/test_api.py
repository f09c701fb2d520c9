"""Single-process behaviour: selection, bad input, sharding, and the plain-process path."""

import json
import os
import subprocess

import numpy as np
import keras
import pytest

import keras_dist
from keras_dist import strategies
from keras_dist.inputs import arrays
from keras_dist.launchers.processes import free_ports
from keras_dist.errors import KerasDistError
from keras_dist.environments import LocalEnvironment
from keras_dist.settings import Settings

from runner import BIN, JOB_SECRET, PYTHON, ROOT, run, selected_backend


def small_model():
    keras.utils.set_random_seed(3)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="relu"), keras.layers.Dense(1)])


def test_without_a_launcher_the_script_runs_as_one_plain_process(capsys):
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    plain = small_model()
    plain.compile(optimizer="adam", loss="mse")
    plain.fit(x, y, batch_size=8, epochs=2, verbose=0)
    distributed = small_model()
    keras_dist.compile(distributed, optimizer="adam", loss="mse")
    distributed.fit(x, y, batch_size=8, epochs=2, verbose=0)
    for a, b in zip(plain.get_weights(), distributed.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert keras_dist.current().name == "single"
    assert capsys.readouterr().out == ""  # quiet


SAVE_SCALED = """
import sys, keras, keras_dist
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
schedule = keras.optimizers.schedules.ExponentialDecay(0.01, decay_steps=10, decay_rate=0.9)
keras_dist.compile(model, optimizer=keras.optimizers.Adam(schedule), loss="mse", scale_learning_rate=True)
model.save(sys.argv[1])
"""
LOAD_FIRST = """
import sys, keras, keras_dist
model = keras.models.load_model(sys.argv[1])  # before anything calls keras_dist.compile
print(type(model.optimizer.learning_rate).__name__, type(model.optimizer._learning_rate).__name__)
"""


def test_a_script_loads_a_model_with_a_scaled_schedule_before_it_compiles(tmp_path):
    path = tmp_path / "scaled.keras"
    code, out = run([PYTHON, "-c", SAVE_SCALED, path], timeout=120)
    assert code == 0, out[-3000:]
    code, out = run([PYTHON, "-c", LOAD_FIRST, path], timeout=120)
    assert code == 0 and out.strip().splitlines()[-1].endswith("ScaledSchedule"), out[-3000:]


def test_init_reports_topology():
    ctx = keras_dist.init()
    assert (ctx.name, ctx.rank, ctx.size, ctx.local_rank, ctx.is_chief) == ("single", 0, 1, 0, True)


@pytest.mark.parametrize("environ, expected", [
    ({}, "single"),
    ({"HOROVOD_RANK": "0", "HOROVOD_SIZE": "2"}, "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "1"}, "horovod"),
    ({"HOROVOD_RANK": "0", "KERAS_DIST_BACKEND": "single"}, "single"),
])
def test_backend_selection_from_the_environment(environ, expected):
    assert selected_backend(environ) == expected


def test_explicit_backend_wins_over_environment():
    assert selected_backend({"KERAS_DIST_BACKEND": "single"}, "horovod") == "horovod"


def test_unknown_backend_is_a_one_line_error():
    with pytest.raises(KerasDistError, match="unknown keras_dist backend 'bogus'; choose one of: jax, torch, horovod"):
        strategies.strategy_class("bogus")


def test_compile_refuses_what_is_not_a_model():
    with pytest.raises(KerasDistError, match=r"expects a keras.Model .* got Dense; call keras_dist.compile\(model"):
        keras_dist.compile(keras.layers.Dense(1), optimizer="sgd", loss="mse")


def test_compile_refuses_unknown_reduction():
    with pytest.raises(KerasDistError, match="gradient_reduction must be 'mean' or 'sum'"):
        keras_dist.compile(small_model(), optimizer="sgd", loss="mse", gradient_reduction="max")


def test_horovod_requested_but_not_installed_names_the_fix():
    script = ("import sys; sys.modules['horovod'] = None\n"  # as if Horovod were not installed
              "import keras_dist; keras_dist.init(backend='horovod')")
    code, out = run([PYTHON, "-c", script], timeout=120)
    assert code != 0
    assert "KerasDistError: backend 'horovod' needs Horovod: run `keras-dist build-horovod`" in out


def test_arrays_are_interleaved_and_padded_only_for_training():
    x = np.arange(7)
    assert [list(arrays.shard_arrays(x, 3, r, pad=False)) for r in range(3)] == [[0, 3, 6], [1, 4], [2, 5]]
    assert [list(arrays.shard_arrays(x, 3, r, pad=True)) for r in range(3)] == [[0, 3, 6], [1, 4, 0], [2, 5, 1]]
    shards = arrays.shard_arrays({"x": x, "y": x * 10, "sample_weight": None}, 2, 1, pad=False)
    assert list(shards["y"]) == [10, 30, 50] and shards["sample_weight"] is None


@pytest.mark.parametrize("args, message", [
    (["launch", "-n", "0", "x.py"], "-n must be at least 1"),
    (["launch", "-n", "2", "missing.py"], "script 'missing.py' not found"),
    (["launch", "--backend", "horovod", "--ps", "1", "-n", "2", "examples/train.py"], "starts no parameter servers; drop --ps"),
    (["launch", "--nnodes", "2", "examples/train.py"], "--nnodes needs --master-addr HOST[:PORT]"),
    (["launch", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", "examples/train.py"],
     "--node-rank must be from 0 to 1"),
    (["launch", "--nnodes", "2", "--master-addr", "h:port", "examples/train.py"], "the port must be a number"),
    (["launch", "--max-restarts", "-1", "examples/train.py"], "--max-restarts must be 0 or more"),
    (["launch", "--nnodes", "0", "examples/train.py"], "--nnodes must be at least 1"),
    (["launch", "--backend", "parameter_server", "--ps", "1", "--nnodes", "1:2", "--master-addr", "h",
      "examples/train.py"], "(an elastic job) cannot run parameter servers"),
])
def test_launcher_bad_input_is_a_one_line_error(args, message):
    code, out = run([BIN / "keras-dist", *args], timeout=60, cwd=ROOT)
    assert code == 2
    assert out.strip().splitlines()[-1].startswith("keras-dist: error: ") and message in out


def test_launcher_rejects_unknown_backend():
    code, out = run([BIN / "keras-dist", "launch", "--backend", "bogus", "x.py"], timeout=60)
    assert code == 2 and "invalid choice: 'bogus'" in out


def test_launch_fails_fast_when_one_task_dies(tmp_path):
    script = tmp_path / "one_dies.py"
    script.write_text("import os, sys, time\n"
                      "if os.environ['HOROVOD_RANK'] == '1': sys.exit(7)\n"
                      "time.sleep(600)\n")
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, script], timeout=90)
    assert code != 0
    assert "exited with" in out


def test_max_restarts_restarts_a_failed_job_and_says_when_fit_starts_over(tmp_path):
    script = tmp_path / "fails_once.py"
    script.write_text("import os, sys\n"
                      "import keras, numpy as np, keras_dist\n"
                      "ctx = keras_dist.init()\n"
                      "if os.environ['KERAS_DIST_RESTART'] == '0' and ctx.rank == 1: sys.exit(7)\n"
                      "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
                      "keras_dist.compile(model, optimizer='sgd', loss='mse')\n"
                      "model.fit(np.ones((8, 2)), np.ones((8, 1)), epochs=1, verbose=0)\n")
    code, out = run([BIN / "keras-dist", "launch", "--backend", "torch", "-n", 2, "--max-restarts", 2, script],
                    timeout=240)
    assert code == 0, out[-3000:]
    assert out.count("restart 1 of 2") == 1 and "restart 2 of 2" not in out
    assert "this is restart 1 of the job and fit has no keras.callbacks.BackupAndRestore, so training starts over" in out


@pytest.mark.parametrize("data, said", [
    ("np.ones((8, 2)), np.ones((8, 1)), shuffle=False", 0),
    ("((np.ones((4, 2)), np.ones((4, 1))) for _ in range(2))", 1),
], ids=["arrays", "generator"])
def test_an_elastic_job_says_at_the_start_of_fit_when_its_input_cannot_resume_on_another_count(tmp_path, data, said):
    """`--nnodes 1:2` on one machine alone (the master starts without the second after its
    wait): a generator cannot resume on another number of processes, which the chief says
    in one line before training; arrays (shuffled or not) can, and nothing is said."""
    script = tmp_path / "fits.py"
    script.write_text("import keras, numpy as np, keras_dist\n"
                      "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
                      "keras_dist.compile(model, optimizer='sgd', loss='mse')\n"
                      f"model.fit({data}, epochs=1, verbose=0)\n")
    port = free_ports(1)[0]
    code, out = run([BIN / "keras-dist", "launch", "--backend", "torch", "-n", 2, "--nnodes", "1:2", "--node-rank", 0,
                     "--master-addr", f"127.0.0.1:{port}", script], timeout=240,
                    env={"KERAS_DIST_JOB_SECRET": JOB_SECRET})
    assert code == 0 and "attempt 0: 1 of 2 machines (node ranks 0)" in out, out[-3000:]
    warned = out.count("this elastic job (--nnodes MIN:MAX) cannot resume this fit on another number of processes")
    assert warned == said, out[-3000:]


def test_backend_options_are_checked():
    with pytest.raises(KerasDistError, match="backend 'single' takes no option tpu; remove it from keras_dist.init"):
        strategies.create("single", LocalEnvironment(), Settings(), tpu="my-tpu")


def test_learning_rate_warmup_leaves_the_rate_alone_when_resumed_past_the_ramp():
    class RestoreDecayedRate(keras.callbacks.Callback):  # what BackupAndRestore does after a decay
        def on_train_begin(self, logs=None):
            self.model.optimizer.learning_rate = 0.01

    x = np.zeros((32, 4), "float32")
    model = small_model()
    keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, x[:, :1], batch_size=8, epochs=3, initial_epoch=2, verbose=0,
              callbacks=[keras_dist.callbacks.LearningRateWarmup(warmup_epochs=1), RestoreDecayedRate()])
    assert float(model.optimizer.learning_rate) == pytest.approx(0.01)


def test_compiling_twice_wraps_keras_methods_once():
    """The transfer-learning recipe: freeze, compile, fit; unfreeze, compile again, fit."""
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    model = small_model()
    model.layers[0].trainable = False
    keras_dist.compile(model, optimizer="sgd", loss="mse")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    model.layers[0].trainable = True
    keras_dist.compile(model, optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    model.fit(x, x[:, :1], epochs=1, verbose=0)
    assert model.fit.__self__ is model._keras_dist  # this compile's wrapper, over Keras's own method
    assert model._keras_dist.keras_fit.__func__ is type(model).fit
    assert isinstance(model.optimizer, keras.optimizers.Adam) and int(model.optimizer.iterations) == 1


def test_every_optimizer_a_model_holds_is_found():
    from keras_dist.optimizer_hooks import optimizers_of

    model = small_model()
    model.compile(optimizer="sgd", loss="mse")
    model.g_optimizer = keras.optimizers.Adam()
    model.pair = [keras.optimizers.SGD(), model.g_optimizer]
    found = optimizers_of(model)
    assert [type(o).__name__ for o in found] == ["SGD", "Adam", "SGD"]


# As on Windows: the POSIX-only modules cannot be imported.
WITHOUT_POSIX_MODULES = """
import sys
for name in ("fcntl", "resource", "termios"):
    sys.modules[name] = None
"""
TRAIN_TWO_LINE_SCRIPT = WITHOUT_POSIX_MODULES + """
import numpy as np, keras
import keras_dist
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
model.fit(np.ones((8, 3)), np.ones((8, 1)), verbose=0)
print("trained on", keras_dist.current().name)
"""
INFO = WITHOUT_POSIX_MODULES + """
from keras_dist.cli import main
sys.exit(main(["info"]))
"""


@pytest.mark.parametrize("keras_backend", ["jax", "torch"])
def test_without_posix_only_modules_keras_dist_imports_trains_and_answers_info(keras_backend):
    pytest.importorskip(keras_backend)
    env = {"KERAS_BACKEND": keras_backend}
    code, out = run([PYTHON, "-c", TRAIN_TWO_LINE_SCRIPT], timeout=120, env=env)
    assert code == 0 and "trained on single" in out, out[-3000:]
    code, out = run([PYTHON, "-c", INFO], timeout=120, env=env)
    assert code == 0 and '"backend"' in out, out[-3000:]


# Stands in for an install that lacks a module: importing it fails, as where it is absent.
WITHOUT_MODULES = "import os, sys\nfor name in os.environ['KERAS_DIST_TEST_ABSENT'].split(','):\n    sys.modules[name] = None\n"


@pytest.mark.parametrize("absent, keras_backend, argv, fix", [
    # A [jax] install with Keras's default backend: `keras-dist info` printed a 30-line traceback.
    ("tensorflow", None, ["info"], 'set KERAS_BACKEND=jax (installed), or pip install "keras_dist[tf]"'),
    ("tensorflow", None, ["launch", "-n", "1", "SCRIPT"], 'or pip install "keras_dist[tf]"'),
    ("tensorflow", "jax", ["launch", "--backend", "multi_worker_mirrored", "-n", "1", "SCRIPT"],
     'runs on TensorFlow, which is not installed: pip install "keras_dist[tf]"'),
    ("horovod", "tensorflow", ["launch", "--backend", "horovod", "-n", "1", "SCRIPT"], "run keras-dist build-horovod"),
    ("tensorflow", "jax", ["build-horovod"], 'which is not installed: pip install "keras_dist[tf]"'),
    ("torch", "torch", ["info"], 'pip install "keras_dist[torch]"'),
])
def test_the_cli_says_in_one_line_what_is_missing_and_what_installs_it(tmp_path, absent, keras_backend, argv, fix):
    (tmp_path / "sitecustomize.py").write_text(WITHOUT_MODULES)
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the script must not start')\n")
    env = {"PYTHONPATH": str(tmp_path), "KERAS_DIST_TEST_ABSENT": absent, "KERAS_BACKEND": keras_backend or "",
           "KERAS_HOME": str(tmp_path)}
    done = subprocess.run([BIN / "keras-dist", *[str(script) if a == "SCRIPT" else a for a in argv]],
                          env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and fix in lines[0], done.stdout[-2000:] + done.stderr[-2000:]


# Stands in for Horovod's torch ops built against another PyTorch: their library fails to load.
BROKEN_HOROVOD_TORCH = """
import sys
class BrokenOps:
    def find_spec(self, name, path=None, target=None):
        if name == "horovod.torch.mpi_lib_v2":
            raise ImportError("mpi_lib_v2.cpython-311-x86_64-linux-gnu.so: undefined symbol: _ZN3c1013MessageLoggerC1E")
sys.meta_path.insert(0, BrokenOps())
"""


def test_info_says_whether_horovods_ops_load_for_each_framework_and_names_the_fix(tmp_path):
    pytest.importorskip("horovod")
    pytest.importorskip("torch")
    (tmp_path / "sitecustomize.py").write_text(BROKEN_HOROVOD_TORCH)
    env = {"PYTHONPATH": str(tmp_path), "KERAS_BACKEND": "jax", "KERAS_HOME": str(tmp_path)}
    done = subprocess.run([BIN / "keras-dist", "info"], env={**os.environ, **env}, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    horovod = json.loads(done.stdout)["horovod"]
    assert horovod["tensorflow"]["ops"] == "load" and horovod["tensorflow"]["gloo"] is True, horovod
    assert "undefined symbol" in horovod["torch"] and "fix: keras-dist build-horovod" in horovod["torch"], horovod


# Counts, in each process, the calls that derive a fact the runtime holds (Python's profiler
# sees every call, keras_dist's own start-up included).
COUNT_DERIVATIONS = """
import atexit, collections, os, sys
counts = collections.Counter()
WATCHED = {("strategies/__init__.py", "select"): "select", ("environments.py", "detect"): "detect",
           ("settings.py", "Settings.from_environ"): "settings", ("network.py", "interface_variables"): "interface"}
def profile(frame, event, arg):
    if event == "call" and "keras_dist" in frame.f_code.co_filename:
        where = (frame.f_code.co_filename.split("keras_dist" + os.sep, 1)[-1], frame.f_code.co_qualname)
        if where in WATCHED:
            counts[WATCHED[where]] += 1
        elif where[0] == "environments.py" and where[1].endswith("Environment.from_environ"):
            counts["parse"] += 1
sys.setprofile(profile)
atexit.register(lambda: print("derivations", dict(sorted(counts.items())), flush=True))
"""


def test_each_task_selects_its_strategy_and_reads_its_environment_once(tmp_path):
    pytest.importorskip("torch")
    (tmp_path / "sitecustomize.py").write_text(COUNT_DERIVATIONS)
    script = tmp_path / "train.py"
    script.write_text("import numpy as np, keras\nimport keras_dist\n"
                      "model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])\n"
                      "keras_dist.compile(model, optimizer='sgd', loss='mse')\n"
                      "model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=2, verbose=0)\n"
                      "model.evaluate(np.ones((4, 3)), np.ones((4, 1)), verbose=0)\n"
                      "keras_dist.init(); keras_dist.current()\n")
    code, out = run([BIN / "keras-dist", "launch", "-n", 2, script], timeout=240,
                    env={"KERAS_BACKEND": "torch", "PYTHONPATH": str(tmp_path)})
    assert code == 0, out[-3000:]
    tasks = [line for line in out.splitlines() if line.startswith("[rank:") and "derivations" in line]
    once = "{'detect': 1, 'interface': 1, 'parse': 1, 'select': 1, 'settings': 1}"
    assert sorted(tasks) == [f"[rank:{rank}] derivations {once}" for rank in (0, 1)], out[-3000:]


def test_a_peer_failure_reads_the_same_whichever_engine_noticed_it():
    from keras_dist.errors import PeerFailure

    failure = PeerFailure(["rank 1 on node1", "rank 3 on node2"], "10 s", "or raise KERAS_DIST_STEP_TIMEOUT",
                          cause="Connection closed by peer\n  at gloo")
    assert isinstance(failure, KerasDistError) and failure.stopped == ["rank 1 on node1", "rank 3 on node2"]
    assert str(failure) == ("rank 1 on node1, rank 3 on node2 stopped answering within 10 s (Connection closed by "
                            "peer): its machine froze, lost its network or ended; or raise KERAS_DIST_STEP_TIMEOUT")
    assert str(PeerFailure([], None, "restart the job")) == ("a peer stopped answering: its machine froze, lost its "
                                                             "network or ended; restart the job")
