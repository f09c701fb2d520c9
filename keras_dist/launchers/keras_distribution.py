"""The variables `keras.distribution.initialize` reads (JAX's coordinator), on one machine or several."""

import os
import sys

from keras_dist.environments import threads_per_process
from keras_dist.launchers.base import Launcher, Task
from keras_dist.launchers.processes import free_ports


class KerasDistributionLauncher(Launcher):
    """One task per process: `KERAS_DISTRIBUTION_JOB_ADDRESSES` (the coordinator on
    loopback), `KERAS_DISTRIBUTION_NUM_PROCESSES` and `KERAS_DISTRIBUTION_PROCESS_ID`."""

    name = "keras_distribution"

    def _tasks(self, num_workers, num_ps, argv, nodes):
        # Across machines the master's address, where process 0 serves the coordinator.
        coordinator = nodes.master_address if nodes else f"127.0.0.1:{free_ports(1)[0]}"
        first = nodes.rank * num_workers if nodes else 0
        size = num_workers * (nodes.count if nodes else 1)
        env = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": coordinator, "KERAS_DISTRIBUTION_NUM_PROCESSES": str(size),
               "PYTHONUNBUFFERED": "1"}
        flags = os.environ.get("XLA_FLAGS", "")
        if num_workers > 1 and "intra_op_parallelism_threads" not in flags:
            # Processes sharing this machine would each size XLA's CPU thread pool for all
            # of it; XLA reads its flags once, when JAX starts, so they go in up front.
            threads = threads_per_process(num_workers)
            env["XLA_FLAGS"] = f"{flags} --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads={threads}".strip()
        # LOCAL_RANK and LOCAL_WORLD_SIZE (torchrun's names): which of this machine's GPUs a process takes.
        return [Task(f"rank:{i}", [sys.executable, *argv], env={**env, "KERAS_DISTRIBUTION_PROCESS_ID": str(i),
                                                               "LOCAL_RANK": str(i - first),
                                                               "LOCAL_WORLD_SIZE": str(num_workers)})
                for i in range(first, first + num_workers)]
