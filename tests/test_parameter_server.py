"""Parameter-server backend: real clusters of processes on 127.0.0.1 (chief, workers, ps)."""

import json
import os
import re
import signal
import subprocess
import threading
import time

import keras
import numpy as np
import pytest
import tensorflow as tf

from runner import BIN, PYTHON, QUIET_ENV, ROOT, WORKERS, run, selected_backend
from keras_dist import strategies
from keras_dist import launchers
from keras_dist import timeouts
from keras_dist.strategies.parameter_server import step_watch
from keras_dist.strategies.parameter_server.loop import CoordinatedSteps, refuse_batch_log_readers
from keras_dist.strategies.parameter_server.strategy import ParameterServerStrategy
from keras_dist.errors import KerasDistError
from keras_dist.launchers.processes import LAUNCHER_PID_VARIABLE, kill_process_groups, process_ended
from keras_dist.network import tcp_listeners
from keras_dist.environments import LocalEnvironment
from keras_dist.settings import Settings

pytestmark = pytest.mark.timeout(600)
EXAMPLES = ROOT / "examples"


class LocalCluster:
    """The tasks `keras-dist launch --backend parameter_server` would start, started here so
    a test can kill and restart single tasks. Every process group dies at `close`."""

    def __init__(self, num_workers, num_ps, argv):
        self.tasks = {t.name: t for t in launchers.create(strategies.launcher_of("parameter_server")).tasks(num_workers, num_ps, [str(a) for a in argv])}
        self.procs = {}
        self.chief_lines = []
        for name in self.tasks:
            self.start(name)
        threading.Thread(target=self._read_chief, daemon=True).start()

    def start(self, name):
        task = self.tasks[name]
        base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
        self.procs[name] = subprocess.Popen(
            task.argv, env={**base, **QUIET_ENV, **task.env}, stdout=subprocess.PIPE if name == "chief:0" else
            subprocess.DEVNULL, stderr=subprocess.STDOUT, text=True, start_new_session=True)

    def _read_chief(self):
        for line in self.procs["chief:0"].stdout:
            self.chief_lines.append(line)

    def kill(self, name):
        os.killpg(self.procs[name].pid, signal.SIGKILL)
        self.procs[name].wait()

    def wait_until_listening(self, name, timeout):
        port = int(json.loads(self.tasks[name].env["TF_CONFIG"])["cluster"][name.split(":")[0]][
            int(name.split(":")[1])].rsplit(":", 1)[1])
        deadline = time.monotonic() + timeout
        while port not in {p for _, p, _ in tcp_listeners()}:
            if time.monotonic() > deadline:
                pytest.fail(f"{name} is not listening on port {port} after {timeout}s")
            time.sleep(0.1)

    def wait_for_line(self, text, timeout):
        deadline = time.monotonic() + timeout
        while not any(text in line for line in self.chief_lines):
            if time.monotonic() > deadline or self.procs["chief:0"].poll() is not None:
                pytest.fail(f"chief never printed {text!r}; output:\n{''.join(self.chief_lines)[-4000:]}")
            time.sleep(0.05)
        return time.monotonic()

    def wait_chief(self, timeout):
        try:
            code = self.procs["chief:0"].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"chief did not finish in {timeout}s; output:\n{''.join(self.chief_lines)[-4000:]}")
        time.sleep(0.2)  # let the reader thread take the last lines
        return code, "".join(self.chief_lines)

    def close(self):
        kill_process_groups(list(self.procs.values()))


@pytest.fixture
def cluster_factory():
    clusters = []

    def start(*args):
        clusters.append(LocalCluster(*args))
        return clusters[-1]

    yield start
    for cluster in clusters:
        cluster.close()


def launch(num_workers, num_ps, argv, env=None, timeout=400):
    return run([BIN / "keras-dist", "launch", "--backend", "parameter_server", "-n", num_workers, "--ps", num_ps,
                *argv], timeout=timeout, env=env)


def load(path):
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("model, num_ps, min_shard_bytes", [("sequential", 1, ""), ("custom-step", 1, ""),
                                                            ("sequential", 2, "16")])
def test_one_worker_trains_exactly_like_one_process(tmp_path, model, num_ps, min_shard_bytes):
    # One worker runs one step at a time: asynchronous training degenerates to plain SGD.
    # A custom train_step's epoch logs are its last step's, as in Keras. With 16-byte
    # shards the hidden kernel (5x4 floats) is split over both ps tasks (dense gradients).
    args = ("--batch", 16, "--samples", 72, "--eval-samples", 17, "--model", model)
    (tmp_path / "ps").mkdir()
    (tmp_path / "single").mkdir()
    code, out = launch(1, num_ps, [WORKERS / "train_worker.py", tmp_path / "ps", *args],
                       env={"KERAS_DIST_MIN_SHARD_BYTES": min_shard_bytes})
    assert code == 0, out[-4000:]
    code, out = run([PYTHON, WORKERS / "train_worker.py", tmp_path / "single", *args], timeout=200,
                    env={"KERAS_DIST_BACKEND": "single"})
    assert code == 0, out[-4000:]
    ps, single = load(tmp_path / "ps" / "result-0.json"), load(tmp_path / "single" / "result-0.json")
    assert ps["describe"]["backend"] == "parameter_server"
    assert ps["shards"] == ([2, 1, 1, 1] if min_shard_bytes else [1, 1, 1, 1])
    assert ps["weights"] == single["weights"]
    assert ps["history"] == single["history"]  # loss, mae, val_loss, val_mae per epoch
    assert ps["evaluate"] == single["evaluate"]
    assert ps["predict"] == single["predict"]


def test_recommendation_example_with_sharded_tables_converges_like_one_process(tmp_path):
    env = {"EPOCHS": "2", "BATCH_SIZE": "256", "OUTPUT": str(tmp_path / "out")}
    # The user table (5000 x 16 floats, 320 KB) is split over both ps tasks, the item table (32 KB) is not.
    code, out = launch(2, 2, [EXAMPLES / "recommendation.py"], env={**env, "KERAS_DIST_MIN_SHARD_BYTES": "65536"})
    assert code == 0, out[-4000:]
    distributed = float(re.search(r"\[chief:0\] test accuracy: ([0-9.]+)", out).group(1))
    # Each step trains one per-worker batch (256) on one worker: 100000 samples, 391 steps.
    assert "[chief:0] 391/391" in out, out[-3000:]
    assert "[chief:0] user table on /job:ps/replica:0/task:0/device:CPU:0, /job:ps/replica:0/task:1/device:CPU:0" \
        in out, out[-2000:]
    assert "[worker:0] Epoch" not in out and "[chief:0] Epoch 2/2" in out  # only the chief runs the script
    code, out = run([PYTHON, EXAMPLES / "recommendation.py"], timeout=300, env={**env, "KERAS_DIST_BACKEND": "single"})
    assert code == 0, out[-4000:]
    single = float(re.search(r"test accuracy: ([0-9.]+)", out).group(1))
    assert single > 0.8  # far above chance (0.5): the tables were learnt
    assert distributed == pytest.approx(single, abs=0.03)
    assert len((tmp_path / "out" / "log.csv").read_text().splitlines()) == 3


def test_training_and_evaluation_survive_killed_workers_and_take_them_back(tmp_path, cluster_factory):
    epochs, steps = 4, 150
    cluster = cluster_factory(2, 1, [WORKERS / "ps_training.py", tmp_path, epochs, steps, "--hold-evaluation"])
    cluster.wait_for_line("epoch 1 begin", timeout=240)
    # Every task of the cluster serves gRPC, on loopback only (TensorFlow alone: all interfaces).
    ports = {int(a.rsplit(":", 1)[1]) for t in cluster.tasks.values()
             for kind in json.loads(t.env["TF_CONFIG"])["cluster"].values() for a in kind}
    listening = {(getattr(address, "ipv4_mapped", None) or address, port) for address, port, _ in tcp_listeners()
                 if port in ports}
    assert {port for _, port in listening} == ports
    assert all(address.is_loopback for address, _ in listening), listening
    time.sleep(0.5)  # mid-epoch
    cluster.kill("worker:1")
    cluster.wait_for_line("epoch 2 begin", timeout=240)
    cluster.start("worker:1")  # same address: the coordinator reconnects to it
    cluster.wait_for_line("evaluate step 8", timeout=300)
    # Evaluation waits with finished steps unfetched; worker:1 goes again, so they are
    # rerun and the rest of evaluate and predict run on worker:0. (Killing worker:0
    # instead could leave no worker while worker:1 is still being taken back; TensorFlow
    # then waits for both.)
    cluster.wait_until_listening("worker:1", timeout=60)
    time.sleep(3)  # the coordinator polls for restarted workers
    cluster.kill("worker:1")
    (tmp_path / "resume").touch()
    code, out = cluster.wait_chief(timeout=300)
    assert code == 0, out[-4000:]
    result = load(tmp_path / "result.json")
    assert result["epochs_run"] == list(range(epochs))
    # Every requested step ran. A step cut off mid-update is retried, and one finished
    # but not yet fetched is rerun: each may train its batch twice.
    assert epochs * steps <= result["iterations"] <= epochs * steps + 2
    assert result["history"]["loss"][-1] < result["history"]["loss"][0]
    # evaluate counts each example once, though a worker died mid-way: it equals the
    # MSE of the final weights, as does predict.
    assert result["evaluate"]["loss"] == pytest.approx(result["reference_mse"], rel=1e-4)
    assert result["predict_error"] < 1e-4
    print("epoch seconds (worker:1 killed in epoch 1, back from epoch 2):", result["epoch_seconds"])


def test_losing_a_ps_stops_the_job_and_a_rerun_resumes_from_the_last_epoch(tmp_path, cluster_factory):
    epochs, steps = 3, 150
    argv = [WORKERS / "ps_training.py", tmp_path, epochs, steps]
    cluster = cluster_factory(1, 1, argv)
    cluster.wait_for_line("epoch 1 begin", timeout=240)  # epoch 0 is in the backup
    cluster.kill("ps:0")
    killed = time.monotonic()
    code, out = cluster.wait_chief(timeout=180)
    assert code != 0
    print(f"ps:0 killed mid-epoch 1: the chief ended {time.monotonic() - killed:.1f} s later")
    # The error ends the chief's traceback, or a worker thread's report of it.
    errors = [line for line in out.splitlines() if "PeerFailure: " in line]
    assert errors and "/job:ps/task:0 (127.0.0.1:" in errors[0] and "restart the job" in errors[0], out[-3000:]
    cluster.close()

    rerun = cluster_factory(1, 1, argv)
    code, out = rerun.wait_chief(timeout=300)
    assert code == 0, out[-4000:]
    assert load(tmp_path / "result.json")["epochs_run"] == [1, 2]  # no completed epoch lost or redone


def test_detected_from_tf_config_with_ps_tasks():
    cluster = {"chief": ["127.0.0.1:1"], "worker": ["127.0.0.1:2"], "ps": ["127.0.0.1:3"]}
    config = json.dumps({"cluster": cluster, "task": {"type": "worker", "index": 0}})
    assert selected_backend({"TF_CONFIG": config}) == "parameter_server"


@pytest.mark.parametrize("cluster, task, fix", [
    ({"worker": ["a:1"], "ps": ["a:2"]}, "worker", "exactly one 'chief'"),
    ({"chief": ["a:0"], "worker": ["a:1"], "ps": ["a:2"], "evaluator": ["a:3"]}, "evaluator", "drop it from TF_CONFIG"),
])
def test_unusable_clusters_get_a_one_line_error(cluster, task, fix):
    config = json.dumps({"cluster": cluster, "task": {"type": task, "index": 0}})
    with pytest.raises(KerasDistError, match=fix) as error:
        ParameterServerStrategy.process_setup.process_variables(LocalEnvironment(), Settings.from_environ({"TF_CONFIG": config}))
    assert "\n" not in str(error.value)


def test_launcher_describes_chief_workers_and_servers():
    tasks = launchers.create(strategies.launcher_of("parameter_server")).tasks(2, 1, ["train.py"])
    assert [(t.name, t.serves) for t in tasks] == [("chief:0", False), ("worker:0", True), ("worker:1", True),
                                                   ("ps:0", True)]
    config = json.loads(tasks[0].env["TF_CONFIG"])
    addresses = [a for kind in config["cluster"].values() for a in kind]
    assert len(set(addresses)) == 4 and all(a.startswith("127.0.0.1:") for a in addresses)
    with pytest.raises(KerasDistError, match="add --ps 1"):
        launchers.create(strategies.launcher_of("parameter_server")).tasks(2, 0, ["train.py"])


class ReadsBatchLogs(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        print(logs["loss"])


class RampsTheRate(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        pass


def test_callbacks_that_need_batch_logs_are_refused_in_one_line(tmp_path):
    with pytest.raises(KerasDistError, match="ReadsBatchLogs reads per-batch logs") as error:
        refuse_batch_log_readers(keras.callbacks.CallbackList([ReadsBatchLogs()]))
    assert "\n" not in str(error.value)
    with pytest.raises(KerasDistError, match="ModelCheckpoint"):
        refuse_batch_log_readers(keras.callbacks.CallbackList(
            [keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras"), save_freq=10)]))
    for callback in (keras.callbacks.TerminateOnNaN(), keras.callbacks.LambdaCallback(on_train_batch_end=print),
                     keras.callbacks.TensorBoard(str(tmp_path / "tb"), update_freq=5)):
        with pytest.raises(KerasDistError, match=type(callback).__name__):
            refuse_batch_log_readers(keras.callbacks.CallbackList([callback]))
    refuse_batch_log_readers(keras.callbacks.CallbackList([
        RampsTheRate(), keras.callbacks.ModelCheckpoint(str(tmp_path / "m.keras")),
        keras.callbacks.TensorBoard(str(tmp_path / "tb")), keras.callbacks.CSVLogger(str(tmp_path / "log.csv")),
        keras.callbacks.EarlyStopping(), keras.callbacks.ProgbarLogger()]))


def test_inputs_of_unknown_length_ask_for_steps_in_one_line():
    # Both checks run before anything is scheduled: no cluster is needed to reach them.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    steps = CoordinatedSteps(model, strategy=None, coordinator=None)
    with pytest.raises(KerasDistError, match="pass steps_per_epoch to fit"):
        steps.fit(lambda input_context: tf.data.Dataset.range(4), epochs=1)
    with pytest.raises(KerasDistError, match="has no batches"):
        steps.fit(np.zeros((0, 2), "float32"), np.zeros((0, 1), "float32"))
    endless = tf.data.Dataset.from_tensors(([0.0, 0.0], [0.0])).repeat().batch(2)
    with pytest.raises(KerasDistError, match="pass steps_per_epoch .*validation_steps or steps") as error:
        steps.evaluate(endless)
    assert "\n" not in str(error.value)


def test_a_frozen_worker_stops_the_job_in_one_line_instead_of_stalling_it(tmp_path, cluster_factory, monkeypatch):
    monkeypatch.setenv("KERAS_DIST_STEP_TIMEOUT", "5")
    cluster = cluster_factory(2, 1, [WORKERS / "ps_training.py", tmp_path, 2, 100])
    cluster.wait_for_line("epoch 1 begin", timeout=240)  # past the first, traced steps
    os.killpg(cluster.procs["worker:1"].pid, signal.SIGSTOP)
    frozen = time.monotonic()
    try:
        code, out = cluster.wait_chief(timeout=60)
    finally:
        os.killpg(cluster.procs["worker:1"].pid, signal.SIGCONT)
    assert code != 0 and time.monotonic() - frozen < 60
    print(f"worker:1 frozen mid-epoch 1: the chief ended {time.monotonic() - frozen:.1f} s later (step timeout 5 s)")
    errors = [line for line in out.splitlines() if line.startswith("keras_dist.errors.PeerFailure")]
    # Named by probing the workers: worker 0's steps can wait behind the frozen one's.
    assert errors and re.search(r"PeerFailure: /job:worker/task:1 \(\S+\) stopped answering within 5 s \(a step "
                                r"did not finish\)", errors[0]), out[-3000:]


class FakeRemote:
    """A `RemoteValue` whose `fetch` returns `value` once `release` is set (never: a frozen worker's step)."""

    def __init__(self, value=None):
        self.value, self.release = value, threading.Event()

    def fetch(self):
        self.release.wait()
        return self.value


@pytest.mark.parametrize("loop_waits", [True, False])
def test_the_step_watch_times_the_oldest_unfinished_step_wherever_the_loop_is(monkeypatch, loop_waits):
    # The loop waiting for a step gets the PeerFailure raised there; a loop elsewhere (inside
    # TensorFlow, which never returns) cannot: the watch ends the process with its line.
    ended = []
    monkeypatch.setattr(step_watch, "_end_process", ended.append)
    stalled = threading.Event()
    watch = step_watch.StepWatch(timeouts.StepTimeout(1.0, 1.0, True), 1, lambda remote: ["/job:worker/task:0 (a:1)"],
                                 stalled)
    finished, frozen = FakeRemote("value"), FakeRemote()
    finished.release.set()
    first, second = watch.add(finished, "train"), watch.add(frozen, "train")
    assert watch.value(first) == "value"  # the clock of the second starts once the first is fetched
    started = time.monotonic()
    if loop_waits:
        with pytest.raises(step_watch.PeerFailure, match=r"^/job:worker/task:0 \(a:1\) stopped answering within 1 s "
                           r"\(a step did not finish\)"):
            watch.value(second)
        assert not ended
    else:
        while not ended and time.monotonic() - started < 30:
            time.sleep(0.05)
        assert len(ended) == 1 and "/job:worker/task:0 (a:1) stopped answering within 1 s" in str(ended[0])
    assert 0.9 <= time.monotonic() - started < 10 and stalled.is_set()
    frozen.release.set()


def _tasks_of(launcher_pid):
    """{"worker:1": pid, ...}: the tasks `keras-dist launch` started (each in a session of its own)."""
    tasks = {}
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
        except (OSError, ValueError):  # not a process, or gone
            continue
        if environ.get(LAUNCHER_PID_VARIABLE.encode()) == str(launcher_pid).encode() and b"TF_CONFIG" in environ:
            task = json.loads(environ[b"TF_CONFIG"])["task"]
            tasks[f"{task['type']}:{task['index']}"] = int(entry)
    return tasks


def test_a_worker_frozen_mid_epoch_ends_a_launched_job_within_the_step_timeout_in_one_line(tmp_path):
    """Issue 58: `keras-dist launch`, 2 workers and 1 ps, NumPy arrays the chief reads batch by
    batch. Worker 1 is stopped (SIGSTOP) mid-epoch while the chief holds at a step. Before, the
    chief's next read of a batch waited inside TensorFlow for the frozen worker's step, where no
    step timeout could end it: every process was still there 180 s later, silent. Now the job
    ends within the step timeout and a margin (naming the worker, the launcher's 5 s for its
    tasks to exit), with one line naming the frozen task, and no process is left."""
    step_timeout, margin = 5, 20
    argv = [BIN / "keras-dist", "launch", "--backend", "parameter_server", "-n", 2, "--ps", 1,
            WORKERS / "ps_training.py", tmp_path, 4, 100, "--arrays", "--hold-train", "2:40"]
    base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    launcher = subprocess.Popen([str(a) for a in argv], env={**base, **QUIET_ENV, "KERAS_DIST_STEP_TIMEOUT":
                                str(step_timeout)}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    lines = []  # (when it arrived, line)
    reader = threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in launcher.stdout),
                              daemon=True)
    reader.start()
    tasks = {}
    try:
        deadline = time.monotonic() + 240
        while not any("[chief:0] train step 40 of epoch 2" in line for _, line in lines):
            assert launcher.poll() is None and time.monotonic() < deadline, "".join(l for _, l in lines)[-4000:]
            time.sleep(0.05)
        tasks = _tasks_of(launcher.pid)
        assert sorted(tasks) == ["chief:0", "ps:0", "worker:0", "worker:1"], tasks
        os.kill(tasks["worker:1"], signal.SIGSTOP)
        frozen = time.monotonic()
        (tmp_path / "resume").touch()  # the chief goes on: its next steps go to both workers
        try:
            launcher.wait(timeout=step_timeout + margin + 60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end {step_timeout + margin + 60} s after worker 1 froze; "
                        f"output:\n{''.join(l for _, l in lines)[-4000:]}")
        ended = time.monotonic()
        reader.join(timeout=10)
        left = {name: pid for name, pid in tasks.items() if not process_ended(pid)}
    finally:
        # By pid, each task being a session of its own; those still ours only (a pid is reused).
        for pid in _tasks_of(launcher.pid).values():
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        kill_process_groups([launcher])
    out = "".join(line for _, line in lines)
    named = [(when, line) for when, line in lines if "/job:worker/task:1 " in line]
    assert len(named) == 1 and out.count("PeerFailure") == 1, out[-4000:]
    assert re.match(r"\[chief:0\] keras_dist\.errors\.PeerFailure: /job:worker/task:1 \(127\.0\.0\.1:\d+\) stopped "
                    rf"answering within {step_timeout} s \(a step did not finish\)", named[0][1]), out[-4000:]
    print(f"worker:1 frozen mid-epoch 2: the line {named[0][0] - frozen:.1f} s later, the job ended "
          f"{ended - frozen:.1f} s later (step timeout {step_timeout} s)")
    assert launcher.returncode != 0 and not left, (launcher.returncode, left)
    assert ended - frozen < step_timeout + margin, out[-4000:]


ENDLESS_PIPELINE = """
import sys
import numpy as np, keras, tensorflow as tf, keras_dist

def preprocess(x, y):
    tf.print("preprocessed", output_stream=sys.stderr)
    return x * tf.random.uniform([], 0.9, 1.1), y  # random augmentation travels with the pipeline

x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
dataset = tf.data.Dataset.from_tensor_slices((x, x[:, :1])).shuffle(64).repeat().map(preprocess)
if sys.argv[1] == "python":  # a Python step cannot run in another process: the chief reads
    dataset = dataset.map(lambda x, y: (tf.numpy_function(lambda v: v, [x], tf.float32), y))
dataset = dataset.batch(4)
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
model.fit(dataset, steps_per_epoch=20, epochs=2, verbose=0)
print("trained", int(model.optimizer.iterations.numpy()))
"""


@pytest.mark.parametrize("ops", ["tensorflow", "python"])
def test_an_endless_dataset_is_preprocessed_by_the_workers_unless_it_runs_python(tmp_path, ops):
    script = tmp_path / "endless.py"
    script.write_text(ENDLESS_PIPELINE)
    code, out = launch(2, 1, [script, ops], timeout=300)
    assert code == 0 and "[chief:0] trained 40" in out, out[-3000:]
    counts = {task: sum(1 for line in out.splitlines() if line.startswith(f"[{task}] preprocessed"))
              for task in ("chief:0", "worker:0", "worker:1")}
    if ops == "tensorflow":
        assert counts["worker:0"] + counts["worker:1"] >= 40 * 4, counts
        # A batch to build the model, and what its iterator read ahead: 2 batches alone, 3 in a
        # loaded suite run; training's 40 batches would be 160.
        assert counts["chief:0"] <= 16, counts
    else:
        assert counts["worker:0"] + counts["worker:1"] == 0 and counts["chief:0"] >= 40 * 4, counts
