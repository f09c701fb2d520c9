"""Several machines, simulated (tests/hostbed.py): each engine's own launcher, run once per host.

The hosts name themselves 127.0.1.1, as Debian's and Ubuntu's installers write
/etc/hosts, the case where gloo advertised loopback to its peers (torch's rank 0 hung,
JAX and Horovod failed) and a TensorFlow task could not reach itself once it listened on
the cluster's address only. Each host has its own /tmp (no shared disk) and a second
interface, on which nothing may listen.
"""

import json
import os
import time

import pytest

from conftest import PYTHON, QUIET_ENV, WORKERS, run
from hostbed import HostBed, HostBedError
from test_keras_backends import assert_same_training

pytestmark = pytest.mark.timeout(600)
WORKER = WORKERS / "any_backend_worker.py"
OUT = "/tmp/out"  # on each host's own /tmp


@pytest.fixture
def debian_hosts():
    """Two hosts whose own names resolve to 127.0.1.1; fails in one line where it cannot be made."""
    try:
        with HostBed(2, loopback_names=True, own_tmp=True, pin=True) as bed:
            yield bed
    except HostBedError as exc:
        pytest.fail(str(exc), pytrace=False)


def reference(tmp_path, keras_backend):
    """One plain process at the global batch (16), on this machine."""
    code, output = run([PYTHON, WORKER, tmp_path, "--batch", 16, "--adam"], 300, env={"KERAS_BACKEND": keras_backend})
    assert code == 0, output[-3000:]
    with open(tmp_path / "result-0.json") as f:
        return json.load(f)


def launch_on_hosts(bed, commands, envs, timeout=240):
    """Starts commands[i] on host i; returns (outputs, every listener seen while they ran)."""
    base = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    processes = [bed.start(host, ["sh", "-c", f'mkdir -p {OUT} && exec "$@"', "sh", *command],
                           env={**base, **QUIET_ENV, **env})
                 for host, command, env in zip(bed.hosts, commands, envs)]
    deadline = time.monotonic() + timeout
    listeners = set()
    while any(p.poll() is None for p in processes):
        if time.monotonic() > deadline:
            tails = "\n".join(bed.output(p)[-2000:] for p in processes)
            bed.close()
            pytest.fail(f"the job did not end in {timeout} s; output tails:\n{tails}")
        for host in bed.hosts:
            listeners |= {(host.name, address) for address, _ in bed.listeners(host)}
        time.sleep(0.3)
    outputs = [bed.output(p) for p in processes]
    for host, process, output in zip(bed.hosts, processes, outputs):
        assert process.returncode == 0, f"{host.name}:\n{output[-4000:]}"
    return outputs, listeners


def results(bed):
    found = []
    for rank, host in enumerate(bed.hosts):
        with open(host.tmp / "out" / f"result-{rank}.json") as f:
            found.append(json.load(f))
    return found


def assert_cluster_listeners_only(bed, listeners):
    """Nothing listens on all interfaces or on the second network; only on loopback or the bridge's."""
    allowed = {host.name: (host.address, f"::ffff:{host.address}") for host in bed.hosts}
    stray = {(name, address) for name, address in listeners
             if address not in allowed[name] and not address.startswith(("127.", "::ffff:127.", "::1"))}
    assert not stray, stray


@pytest.mark.parametrize("keras_backend", ["jax", "torch"])
def test_gloo_across_hosts_named_on_loopback_matches_one_process_at_twice_the_batch(debian_hosts, tmp_path,
                                                                                     keras_backend):
    pytest.importorskip(keras_backend)
    bed = debian_hosts
    argv = [PYTHON, WORKER, OUT, "--batch", 8, "--adam"]
    if keras_backend == "torch":  # torchrun on each machine, as PyTorch documents it
        commands = [[PYTHON, "-m", "torch.distributed.run", "--nnodes", 2, "--node-rank", i, "--nproc-per-node", 1,
                     "--master-addr", "node0", "--master-port", 29500, *argv[1:]] for i in range(2)]
        envs = [{"KERAS_BACKEND": "torch"}] * 2
    else:  # the variables `keras.distribution.initialize` reads
        commands = [argv] * 2
        envs = [{"KERAS_BACKEND": "jax", "KERAS_DISTRIBUTION_JOB_ADDRESSES": "node0:29600,node1:29600",
                 "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": str(i)} for i in range(2)]
    _, listeners = launch_on_hosts(bed, commands, envs)
    expected = reference(tmp_path, keras_backend)
    for result in results(bed):
        assert_same_training(result, expected)
    if keras_backend == "jax":  # torchrun's own store listens on every interface (torchrun's, not keras_dist's)
        assert_cluster_listeners_only(bed, listeners)


def test_multi_worker_mirrored_across_hosts_named_on_loopback_listens_on_the_cluster_address_only(debian_hosts,
                                                                                                  tmp_path):
    bed = debian_hosts
    cluster = {"worker": ["node0:29700", "node1:29700"]}
    envs = [{"KERAS_BACKEND": "tensorflow", "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": "worker", "index": i}})}
            for i in range(2)]
    _, listeners = launch_on_hosts(bed, [[PYTHON, WORKER, OUT, "--batch", 8, "--adam"]] * 2, envs)
    assert_cluster_listeners_only(bed, listeners)
    assert any(address.endswith(bed.hosts[0].address) for _, address in listeners)  # the check saw the servers
    expected = reference(tmp_path, "tensorflow")
    for result in results(bed):
        assert_same_training(result, expected)

