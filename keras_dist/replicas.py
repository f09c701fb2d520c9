"""The job as input, callbacks, fault tolerance and the console see it: `Replicas`.

A strategy (`keras_dist.strategies`) is an engine adapter: it sets a framework up, builds
the model under it and reduces gradients. What the rooms under it need of the job is
smaller, and is this interface: who this process is among how many (topology), the host
collectives between processes, how the process reads its inputs (`InputPlan`, plain data),
the metric states of every process's batches, and how its checkpoints are written (a
part each strategy declares). Every strategy implements it; so does the tests' simulated rank, which splits
inputs as one rank of a job would without any collective.
"""

import abc
import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

if TYPE_CHECKING:
    import keras

    from keras_dist.collectives import Collectives
    from keras_dist.environments import ClusterEnvironment
    from keras_dist.settings import Settings
    from keras_dist.timeouts import StepTimeout


logger = logging.getLogger("keras_dist")


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """How one process reads the script's inputs: the backend's answer, as plain data.

    `keras_dist.inputs` applies it once, the same way for every backend.

    Args:
        num_shards: into how many interleaved shards the inputs are split (one per
            process that reads; 1: this process reads everything).
        shard_index: this process's shard.
        batch_multiplier: this process's batch is the script's batch times this (the
            replicas one process feeds: a script's batch size is per replica).
        collective_steps: every step is a collective, so evaluation and prediction
            shards that differ in length must still end together on every process.
        marks_equal_steps: the engine must know which `tf.data` shards give every process
            batches of the same number and sizes (MultiWorkerMirrored, which otherwise
            stops each epoch by a collective vote, and loses the batches' static size):
            `keras_dist.inputs` marks them (`inputs.base.mark_equal_steps`), and reads
            unshuffled arrays through `EpochBatches`, which marks its dataset.
    """

    num_shards: int = 1
    shard_index: int = 0
    batch_multiplier: int = 1
    collective_steps: bool = False
    marks_equal_steps: bool = False


class Replicas(abc.ABC):
    """One process's view of its job: topology, host collectives, input plan, metric states.

    `rank` and `size` count processes; `num_replicas` counts model replicas, larger than
    `size` where one process drives several devices. The host collectives run eagerly,
    outside a train step, and every process of the job must call them in the same order.
    """

    name: ClassVar[str] = ""
    # Where the rooms under the strategies read a setting (SLURM requeue) or a wait's bound.
    settings: "Settings"
    step_timeout: "StepTimeout"
    environment: "ClusterEnvironment"

    # --- topology -------------------------------------------------------------
    @property
    @abc.abstractmethod
    def rank(self) -> int:
        """This process's index among `size` processes."""

    @property
    @abc.abstractmethod
    def size(self) -> int:
        """How many processes the job has."""

    @property
    def local_rank(self) -> int:
        return self.environment.local_rank if self.size > 1 else 0

    @property
    def is_chief(self) -> bool:
        return self.rank == 0

    @property
    def num_replicas(self) -> int:
        return self.size

    @property
    def input_plan(self) -> InputPlan:
        """How this process reads the script's inputs (default: one shard per process)."""
        # A process feeds its replicas: its batch is the script's times their number.
        return InputPlan(num_shards=self.size, shard_index=self.rank, batch_multiplier=self.num_replicas // self.size)

    # --- host collectives -------------------------------------------------------
    # The job's processes' host-side collectives (all-gather, broadcast, sum, barrier), run
    # eagerly on host values: the one interface for them (`keras_dist.collectives`).
    collectives: "Collectives"

    # --- checkpoints ---------------------------------------------------------------
    # How this engine's processes write fit's checkpoints (the chief's callbacks, the
    # others' stand-ins, weights whole for a save): `fault_tolerance.checkpoint_io.CheckpointIO`,
    # declared by each strategy (typed loosely: fault_tolerance/ sits above this room).
    checkpoint_io: Any

    # --- metric states ------------------------------------------------------------
    # How the metric states of every process's batches are read and set (`MetricStates`,
    # or an engine's own kind of it, made with the strategy).
    metric_states: "MetricStates"

    # --- where variables live and steps run -----------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Context under which the model's and optimizer's variables must be created."""
        return contextlib.nullcontext()

    def process_local_steps(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        """Context in which `evaluate` and `predict` run: where the backend's steps are
        global computations, it makes them run on this process's shard alone."""
        return contextlib.nullcontext()

    def creating_split_weights(self) -> contextlib.AbstractContextManager[None]:
        """Context in which the script builds its model under `keras_dist.split_weights`:
        where the engine can, each trainable variable is made as this process's slice only."""
        if self.size > 1:
            logger.warning("keras_dist.split_weights: the %s backend builds each variable whole; "
                           "shard='weights' splits the trainable ones at fit's start (docs/sharding.md)", self.name)
        return contextlib.nullcontext()

    def after_compile(self, model: "keras.Model") -> None:
        """Called on every process once `keras_dist.compile` compiled `model` and distributed
        its optimizer."""

    def after_initial_sync(self, model: "keras.Model") -> None:
        """Called on every process at fit's start once every process holds the chief's state
        (a restored backup included), before the first step."""

    def describe(self) -> dict:
        return {"backend": self.name, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "num_replicas": self.num_replicas}


class MetricStates:
    """How the metric states of every process's batches are read, set and summed in a step.

    By default each process holds the states of its own batches: they are summed on the
    host, and a resumed epoch's states are held by the chief, the others zero. An engine
    whose states live otherwise (tf.distribute's sync-on-read variables, one global array
    on JAX) subclasses it; one whose step leaves them per process (Horovod, PyTorch) gives
    `sum_in_step`.

    Args:
        replicas: the job as this process sees it (its collectives and chief).
        sum_in_step: sums a list of tensors over processes inside a train step (a
            `tf.function`, or an eager torch step); default: they are the job's already.
    """

    def __init__(self, replicas: "Replicas", sum_in_step: Callable[[Sequence[Any]], Sequence[Any]] | None = None):
        self.replicas = replicas
        self._sum_in_step = sum_in_step

    def global_values(self, variables: Sequence["keras.Variable"]) -> list:
        """The values of metric state `variables` over every process's batches, as NumPy arrays."""
        import keras

        return self.replicas.collectives.sum_arrays([keras.ops.convert_to_numpy(v.value) for v in variables])

    def assign_global(self, variables: Sequence["keras.Variable"], global_states: Sequence[np.ndarray]) -> None:
        """Sets metric state `variables` so that their sum over processes is `global_states`
        (`global_values` inverted, to resume an epoch)."""
        for variable, value in zip(variables, global_states):
            variable.assign(value if self.replicas.is_chief else np.zeros_like(value))

    def sum_in_step(self, tensors: Sequence[Any]) -> Sequence[Any]:
        """`tensors` summed over processes, inside a train step."""
        return tensors if self._sum_in_step is None else self._sum_in_step(tensors)
