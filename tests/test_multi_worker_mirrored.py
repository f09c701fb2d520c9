"""MultiWorkerMirroredStrategy backend: 2 real processes, TF_CONFIG on 127.0.0.1 ports."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import runner

from keras_dist import strategies  # noqa: E402
from keras_dist import launchers
from keras_dist.environments import parse_tf_config  # noqa: E402
from keras_dist.errors import KerasDistError  # noqa: E402

pytestmark = pytest.mark.timeout(600)
PLAIN = os.path.join(os.path.dirname(runner.WORKER), "plain_keras.py")


def test_two_workers_match_one_process_and_write_files_on_the_chief_only(tmp_path):
    # 17 evaluation samples: shards of 9 and 8, two batches against one.
    common = ("--samples", 72, "--eval-samples", 17)
    (single,) = runner.train(tmp_path / "single", "single", "--batch", 16, *common)
    # A temporary directory of their own: other tests' workers (killed ones too) use /tmp meanwhile.
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    workers = runner.train(tmp_path / "mwms", "mwms", "--batch", 8, "--steps-per-execution", 2, "--callbacks", *common,
                           env={"TMPDIR": str(scratch)})
    for result in workers:
        assert result["describe"]["num_replicas"] == 2
        runner.assert_trains_like(result, single)  # every worker logs the global values
    files = sorted(os.listdir(tmp_path / "mwms"))
    assert files == ["ckpt.weights.h5", "log.csv", "result-0.json", "result-1.json"]  # backup removed at the end
    assert not [d for d in os.listdir(scratch) if d.startswith("keras_dist_scratch_")]


def test_a_chief_that_alone_passes_fit_its_checkpoints_stops_every_worker_in_one_line(tmp_path):
    """Every MultiWorkerMirrored save is a collective, which a worker without the chief's
    checkpoints would never join (before: worker 1's traceback, its model check meeting the
    chief's restore)."""
    command = runner.configuration_command("mwms_2", [runner.WORKERS / "any_backend_worker.py", tmp_path,
                                                       "--callbacks", "chief"])
    code, out = runner.run(command, 200, {"KERAS_BACKEND": "tensorflow"})
    said = [line for line in out.splitlines() if "KerasDistError: rank 0 passes fit ['ModelCheckpoint', "
            "'BackupAndRestore'] and rank 1 passes none" in line and "pass them on every process" in line]
    assert code != 0 and 1 <= len(said) <= 2 and "Traceback" not in out, out[-3000:]


def test_the_step_timeout_is_tensorflows_heartbeat_timeout(tmp_path):
    """docs/settings.md: a worker frozen mid-training (SIGSTOP) ends the job once its
    heartbeats have stopped for KERAS_DIST_STEP_TIMEOUT, 20 s here, not at TensorFlow's own
    timeout, 10 s (8.6 s after the freeze, measured); the survivor names it in one line."""
    argv = [sys.executable, runner.WORKER, tmp_path, "--batch", 8, "--samples", 4096, "--epochs", 100, "--callbacks"]
    envs = [{**os.environ, **env, "KERAS_DIST_STEP_TIMEOUT": "20"} for env in runner.tf_config_envs(2)]
    processes = [subprocess.Popen([str(a) for a in argv], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True, start_new_session=True) for env in envs]
    try:
        deadline = time.monotonic() + 180
        while not (tmp_path / "backup").exists():
            assert time.monotonic() < deadline and all(p.poll() is None for p in processes), processes[0].communicate()
            time.sleep(0.05)
        os.kill(processes[1].pid, signal.SIGSTOP)
        frozen = time.monotonic()
        out, _ = processes[0].communicate(timeout=90)
        ended = time.monotonic() - frozen
    finally:
        for process in processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
    print(f"the chief ended {ended:.1f} s after worker 1 froze")
    errors = [line.split("PeerFailure: ", 1)[1] for line in out.splitlines() if "PeerFailure: " in line]
    assert processes[0].returncode != 0 and errors and errors[0].startswith("rank 1 on 127.0.0.1"), out[-3000:]
    assert 12 < ended < 20 + 15, out[-3000:]


def test_upstream_keras_20585_still_fails():
    """Fails once Keras fixes keras-team/keras#20585 / tensorflow#72388: drop the workarounds."""
    for case, message in (("mwms-build", "Attempt to convert a value (PerReplica"),
                          ("mwms-reduce", "Invalid reduction dimension 0 for input with 0 dimensions")):
        # mwms-reduce imports keras_dist for the build fix after the script made its strategy:
        # started under TF_CONFIG, keras_dist would make a second one, whose collectives share
        # instance keys with the script's and fail now and then (1 run in 8 under load).
        envs = [{**env, "KERAS_DIST_BACKEND": "single"} if case == "mwms-reduce" else env
                for env in runner.tf_config_envs(2)]
        outputs = runner.run_python([[PLAIN, case]] * 2, envs)
        for code, out in outputs:
            assert code == 0 and message in out, out[-2000:]


def config(cluster, task):
    return json.dumps({"cluster": cluster, "task": task})


def test_detection_and_topology_from_tf_config(monkeypatch):
    two = {"worker": ["127.0.0.1:1", "127.0.0.1:2"]}
    assert runner.selected_backend({"TF_CONFIG": config(two, {"type": "worker", "index": 1})}) == "multi_worker_mirrored"
    ps = {**two, "ps": ["127.0.0.1:3"]}
    assert runner.selected_backend({"TF_CONFIG": config(ps, {"type": "worker", "index": 0})}) != "multi_worker_mirrored"
    assert parse_tf_config(config({"chief": ["a:1"], **two}, {"type": "worker", "index": 1}))[1:] == ("worker", 1)


@pytest.mark.parametrize("text, fix", [
    ("{not json", "not valid JSON"),
    (config({"worker": ["a:1"]}, None), 'no "task"'),
    (config({"worker": ["a:1", "b:1"]}, {"type": "worker", "index": 2}), "use an index from 0 to 1"),
    (config({"worker": ["a:1", "a:1"]}, {"type": "worker", "index": 0}), "a:1 more than once"),
])
def test_bad_tf_config_gets_a_one_line_error(text, fix):
    with pytest.raises(KerasDistError, match=fix) as error:
        parse_tf_config(text)
    assert "\n" not in str(error.value)


def test_launcher_gives_each_worker_its_own_tf_config():
    tasks = launchers.create(strategies.launcher_of("multi_worker_mirrored")).tasks(2, 0, ["train.py"])
    configs = [json.loads(t.env["TF_CONFIG"]) for t in tasks]
    assert [c["task"]["index"] for c in configs] == [0, 1]
    assert len(set(configs[0]["cluster"]["worker"])) == 2
    with pytest.raises(KerasDistError, match="drop --ps"):
        launchers.create(strategies.launcher_of("multi_worker_mirrored")).tasks(2, 1, ["train.py"])



# Records TF_CPP_MIN_LOG_LEVEL as TensorFlow's import starts (TensorFlow reads it once).
LOG_LEVEL_AT_IMPORT = """
import os, sys
seen = []
class Watch:
    def find_spec(self, name, path=None, target=None):
        if name == "tensorflow" and not seen:
            seen.append(os.environ.get("TF_CPP_MIN_LOG_LEVEL"))
sys.meta_path.insert(0, Watch())
import keras_dist
print("level at TensorFlow's import:", seen, keras_dist.init().name)
"""


def test_a_task_started_by_hand_quiets_tensorflow_before_choosing_its_backend_imports_it():
    # TF_CONFIG set by hand, so no launcher set TF_CPP_MIN_LOG_LEVEL; without the restart that
    # binds the server's address (KERAS_DIST_BIND_ALL), which would inherit the level.
    from keras_dist.launchers.processes import free_ports

    config = json.dumps({"cluster": {"worker": [f"127.0.0.1:{free_ports(1)[0]}"]}, "task": {"type": "worker", "index": 0}})
    code, out = runner.run(["env", "-u", "TF_CPP_MIN_LOG_LEVEL", runner.PYTHON, "-c", LOG_LEVEL_AT_IMPORT], timeout=180,
                           env={"TF_CONFIG": config, "KERAS_BACKEND": "tensorflow", "KERAS_DIST_BIND_ALL": "1"})
    assert code == 0 and "level at TensorFlow's import: ['1'] multi_worker_mirrored" in out, out[-3000:]
