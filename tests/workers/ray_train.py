"""A script run the way Ray Train runs one: inside a trainer's training function, on a local
Ray cluster of two nodes (a head and a worker node, one CPU each, on 127.0.0.1).

    python ray_train.py OUT_DIR TRAINER SCRIPT [SCRIPT's arguments...]

TRAINER: torch (`TorchTrainer`), jax (`JaxTrainer`) or tensorflow (`TensorflowTrainer`),
with 2 workers; the Keras backend is KERAS_BACKEND, which Ray hands its workers. The
training function runs SCRIPT (the two-line Keras script, unchanged) with its arguments.
Ray starts the worker group again once after a failure (`FailureConfig(max_failures=1)`).
Writes OUT_DIR/ray.json: the trainer's class, its error (None where training ended well)
and how long `trainer.fit` took. RAY_TMPDIR names Ray's directory (short: it holds sockets).
"""

import json
import os
import sys
import time

import ray
from ray.cluster_utils import Cluster
from ray.train import FailureConfig, RunConfig, ScalingConfig

out, trainer_name, script, *script_arguments = sys.argv[1:]


def train_function(config: dict) -> None:
    """What a user writes around a script: run it, with its command line."""
    import runpy
    import sys

    sys.argv = [config["script"], *config["arguments"]]
    runpy.run_path(config["script"], run_name="__main__")


def trainer_class(name):
    if name == "torch":
        from ray.train.torch import TorchTrainer

        return TorchTrainer
    if name == "jax":
        from ray.train.v2.jax import JaxTrainer

        return JaxTrainer
    from ray.train.tensorflow import TensorflowTrainer

    return TensorflowTrainer


if __name__ == "__main__":
    node = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}
    # Ray keeps the cluster's address in RAY_TMPDIR/ray, its sessions under `temp_dir`.
    temp_dir = os.path.join(os.environ["RAY_TMPDIR"], "ray")
    os.makedirs(temp_dir, exist_ok=True)
    cluster = Cluster(initialize_head=True, head_node_args={**node, "include_dashboard": False, "temp_dir": temp_dir})
    try:
        cluster.add_node(**node)
        cluster.wait_for_nodes()
        # The cluster's address names this machine's outward interface; its GCS is on 127.0.0.1.
        ray.init(address="127.0.0.1:" + cluster.address.rsplit(":", 1)[1], _node_ip_address="127.0.0.1",
                 runtime_env={"env_vars": {"KERAS_BACKEND": os.environ["KERAS_BACKEND"]}})
        trainer = trainer_class(trainer_name)(
            train_function, train_loop_config={"script": os.path.abspath(script), "arguments": script_arguments},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
            run_config=RunConfig(storage_path=os.path.join(os.path.abspath(out), "ray_results"), name="run",
                                 failure_config=FailureConfig(max_failures=1)))
        started = time.monotonic()
        try:
            error = trainer.fit().error
        except Exception as exc:  # noqa: BLE001 - Ray's own error, reported below
            error = exc
        report = {"trainer": type(trainer).__name__, "error": None if error is None else f"{type(error).__name__}: "
                  f"{error}", "fit_seconds": round(time.monotonic() - started, 1)}
        with open(os.path.join(out, "ray.json"), "w") as f:
            json.dump(report, f)
        print("ray_train:", report, flush=True)
    finally:
        ray.shutdown()
        cluster.shutdown()
