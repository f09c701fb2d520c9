"""TensorFlow servers of a local TF_CONFIG cluster: loopback only, and a clear error for a taken port.

Real worker processes; what listens where is read from the kernel (/proc/net/tcp, tcp6).
"""

import concurrent.futures
import json
import socket
import time

import pytest

import runner

from keras_dist.launchers.processes import free_ports  # noqa: E402
from keras_dist.launchers.binding import BIND_ALL_VARIABLE  # noqa: E402
from keras_dist.network import tcp_listeners  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def is_loopback(address):
    mapped = getattr(address, "ipv4_mapped", None)  # ::ffff:127.0.0.1 on a dual-stack socket
    return address.is_loopback or bool(mapped and mapped.is_loopback)


def train_watching_listeners(out_dir, envs):
    """Trains train_worker.py on two workers; returns their outputs and every listener seen on their ports."""
    ports = {int(json.loads(env["TF_CONFIG"])["cluster"]["worker"][i].rsplit(":", 1)[1]) for i, env in enumerate(envs)}
    argv = [runner.WORKER, str(out_dir)]
    seen = {}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        workers = pool.submit(runner.run_python, [argv, argv], envs)
        while not workers.done():
            for address, port, _ in tcp_listeners():
                if port in ports:
                    seen.setdefault(port, set()).add(address)
            time.sleep(0.05)
        return workers.result(), ports, seen


@pytest.mark.parametrize("bind_all", [False, True], ids=["default", "opt-out"])
def test_local_workers_listen_on_loopback_only_unless_told_otherwise(tmp_path, bind_all):
    envs = runner.tf_config_envs(2)
    if bind_all:
        envs = [{**env, BIND_ALL_VARIABLE: "1"} for env in envs]
    outputs, ports, seen = train_watching_listeners(tmp_path, envs)
    for code, out in outputs:
        assert code == 0, out[-3000:]
    results = [runner.load(tmp_path, rank) for rank in range(2)]
    assert results[0]["describe"]["num_replicas"] == 2 and results[0]["weights"] == results[1]["weights"]
    assert set(seen) == ports, seen  # both servers were up while we looked
    addresses = set().union(*seen.values())
    if bind_all:
        assert any(a.is_unspecified for a in addresses), addresses  # TensorFlow's own wildcard
    else:
        assert all(is_loopback(a) for a in addresses), addresses


@pytest.mark.parametrize("occupant_host", ["127.0.0.1", "0.0.0.0"])
def test_a_taken_port_stops_the_worker_with_one_line(occupant_host):
    with socket.socket() as occupant:
        occupant.bind((occupant_host, 0))
        occupant.listen()
        port = occupant.getsockname()[1]
        workers = [f"127.0.0.1:{port}", f"127.0.0.1:{free_ports(1)[0]}"]
        env = {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": 0}})}
        # A short limit: the error must come at import, not after waiting for the peer.
        code, out = runner.run_python([["-c", "import keras_dist"]], [env], timeout=90)[0]
    assert code != 0
    assert out.rstrip().splitlines()[-1] == (
        f"keras_dist.errors.KerasDistError: TF_CONFIG gives worker:0 the address 127.0.0.1:{port}, "
        "which another process is using; free the port or pick another"
    ), out[-3000:]
