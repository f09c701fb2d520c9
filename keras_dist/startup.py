"""Everything `import keras_dist` does to the process, in one place.

A script changes two lines, so whatever must happen before it builds anything happens
when it imports keras_dist. In a process some launcher started (`keras-dist launch`,
`horovodrun`, `torchrun`, a `TF_CONFIG`...), `start` does, in this order:

1. in a job of several processes, the choice of the network interface that reaches the
   job's coordinator, for every engine that has not been told one (`keras_dist.network`);
   then the variables the selected strategy asks for (`process_variables`: settings the
   framework reads once, such as thread pools), set in the environment in one place
   (`settings.export`), and its `prepare_process`: process groups, and for the TensorFlow
   cluster strategies their server; a TensorFlow task may restart itself there with the
   address-binding library (`keras_dist.launchers.binding`), and a parameter-server `ps`
   or `worker` task serves there and exits;
2. a watcher thread that ends the task once its launcher is gone (`keras-dist launch`);
   in a job of several processes, `keras.utils.get_file` once per machine (`keras_dist.downloads`);
3. when the job has several processes that each build the model (the strategy's
   `shares_random_seed`): the strategy starts (its process group) and every
   process takes the chief's random seed, unless the script seeded itself before. Weights
   initialised without a seed, at any time (a model built after the first compile, a
   lazily built `Sequential`, metric state), are then the same on every process, as
   `keras.distribution.initialize` does for Keras's own multi-process JAX jobs.

A plain process (no launcher) and the `keras-dist` tool itself do none of this.
"""

import dataclasses
import logging
import os
import random
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy

logger = logging.getLogger("keras_dist")


def is_the_cli() -> bool:
    """Whether this process is the `keras-dist` tool, which must never become a task.

    `keras-dist info` / `launch` run with whatever TF_CONFIG the shell has; the tasks it
    launches are separate processes.
    """
    program = (getattr(sys, "argv", None) or [""])[0]
    return os.path.basename(program) == "keras-dist" or program.endswith(os.path.join("keras_dist", "cli.py"))


def start() -> None:
    """The start-up effects of `import keras_dist` (see the module docstring)."""
    if is_the_cli():
        return
    from keras_dist import console, downloads, errors, network, runtime, settings, strategies
    from keras_dist.launchers import processes

    chosen = settings.current()
    if "tensorflow" not in sys.modules:
        # Before the runtime is built: choosing the backend may import TensorFlow, which reads it once.
        settings.export(console.quiet_tensorflow_variables(chosen.variables, chosen))
    try:
        facts = runtime.get()
    except errors.KerasDistError:
        # A launcher's or platform's variables that contradict each other: one line per process.
        errors.uncaught_errors_in_one_line(one_line=not chosen.debug_log)
        raise
    environment = facts.environment
    variables = {}
    if environment.size > 1:
        coordinator = environment.coordinator or getattr(environment, "store", None)
        address, variables = network.interface_variables(chosen.variables, coordinator)
        environment = facts.environment = dataclasses.replace(environment, job_address=address)
        errors.uncaught_errors_in_one_line(one_line=not chosen.debug_log)
    strategy = strategies.strategy_class(facts.backend)
    settings.export({**variables, **strategy.process_setup.process_variables(environment, chosen)})
    strategy.process_setup.prepare_process(environment, chosen)
    processes.watch_launcher(chosen.variables)
    if environment.size > 1:
        downloads.once_per_machine()
    if strategy.shares_random_seed and environment.size > 1:
        share_random_seed(runtime.current())


def share_random_seed(strategy: "Strategy") -> None:
    """Seeds this process with the chief's seed (one collective), unless it seeded itself.

    What Keras's `set_random_seed` seeds (Python's, NumPy's, Keras's global seed
    generator, torch's), less TensorFlow's global seed: Keras's weights do not use it,
    keras_dist already gives unseeded `tf.data` shuffles one seed, and setting it would
    change the order of a shuffle seeded by the script (`shuffle(n, seed=4)`) from one
    plain process's, and so break N replicas at batch B = one process at N*B.
    """
    if strategy.size == 1:
        return
    import keras
    import numpy as np

    from keras_dist import keras_internals

    # Drawn from the OS, not from the generators the seed is about to reset.
    chief_seed = strategy.collectives.broadcast_object(int.from_bytes(os.urandom(4), "little") if strategy.is_chief else None)
    if keras_internals.get_random_seed() is not None:
        return  # the script's own seed wins
    keras_internals.set_global_random_seed(chief_seed)
    random.seed(chief_seed)
    np.random.seed(chief_seed)
    if keras.backend.backend() == "torch":
        import torch

        torch.manual_seed(chief_seed)
    logger.debug("process %d took the job's random seed %d", strategy.rank, chief_seed)
