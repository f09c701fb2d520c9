"""The strategy interface: how Keras 3 trains on N replicas, whatever launched the processes.

The rest of keras_dist (compile/fit wrapping, callbacks, input sharding, the CLI) talks
to a strategy only through this class, so a new one is one module beside the others plus
one line in `keras_dist.strategies.REGISTRY`. Who a process is comes from its cluster
environment (`keras_dist.environments`); what starts a local cluster is a launcher
(`keras_dist.launchers`), which the strategy's registry entry names.

Three families fit behind it:

* process-per-replica strategies (Horovod, PyTorch): every process holds a full copy of
  the model; keras_dist all-reduces gradients and metric states itself.
* `tf.distribute` strategies: TensorFlow replicates variables and reduces gradients and
  metrics inside Keras's step; keras_dist hands out `scope()` and splits the inputs.
* one computation over every process's devices (JAX): XLA reduces inside the step.
"""

import abc
import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from keras_dist import timeouts
from keras_dist.collectives import SINGLE, Collectives
from keras_dist.environments import ClusterEnvironment, LocalEnvironment
from keras_dist.settings import Settings

if TYPE_CHECKING:
    import keras



@dataclass(frozen=True)
class GradientOptions:
    """How gradients are combined across replicas.

    Args:
        reduction: `"mean"` (default) or `"sum"`.
        compression: `None`, `"fp16"` or `"bf16"` (halves the bytes on the wire;
            gradients are cast back to their dtype after the reduction).
    """

    reduction: str = "mean"
    compression: str | None = None


def bucket_bytes(default: int, chosen: Settings) -> int:
    """Bytes of gradients per collective: `KERAS_DIST_BUCKET_BYTES` (in `chosen`, the
    strategy's settings), else the backend's `default`.

    Smaller buckets start communicating earlier in the backward pass; larger ones pay
    fewer collectives' fixed costs. 0: one collective per gradient tensor.
    """
    value = chosen.bucket_bytes
    return default if value is None else value


def buckets(sizes: list[int], dtypes: list, limit: int, first: int | None = None) -> list[list[int]]:
    """Indices of consecutive tensors in runs of one dtype, each closed once it holds `limit` bytes.

    `sizes` and `dtypes` describe the tensors in the order their collectives start. As in
    DDP's bucket assignment, the tensor that reaches the limit joins the run, so a large
    tensor goes out with the small ones ready before it; 0 makes every tensor a run. `first`
    is the first run's limit instead: DDP's first bucket is 1 MiB, so that communication
    starts early in the backward pass.
    """
    runs, total = [], 0
    for i, (nbytes, dtype) in enumerate(zip(sizes, dtypes)):
        cap = first if first is not None and len(runs) == 1 else limit
        if runs and dtype == dtypes[runs[-1][-1]] and total < cap:
            runs[-1].append(i)
            total += nbytes
        else:
            runs.append([i])
            total = nbytes
    return runs


@dataclass(frozen=True)
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
    """

    num_shards: int = 1
    shard_index: int = 0
    batch_multiplier: int = 1
    collective_steps: bool = False


class Strategy(abc.ABC):
    """One way of running a Keras 3 model on several replicas.

    keras_dist calls the strategy a process runs its *backend*: `keras_dist.init(backend=...)`
    and `KERAS_DIST_BACKEND` pick one by `name`. Process topology is in processes (`rank`,
    `size`); `num_replicas` counts model replicas, which is larger than `size` when one
    process drives several devices.

    Args:
        environment: this process's place in its job, as its launcher set it
            (`cluster_environment`), kept as `environment`. Single-process strategies keep
            `rank` 0 and `size` 1 whatever it says.
        chosen: keras_dist's settings, read once (`keras_dist.settings`), kept as
            `settings`; framework variables are read in their `variables`, and the step
            timeout is built from them once (`step_timeout`). A strategy reads no
            environment variable itself. None: the defaults (tests).
    """

    name: ClassVar[str] = ""
    # True when Keras's step computes gradients and metric states from this process's
    # batches alone, and keras_dist's hooks must reduce them (Horovod, PyTorch); False
    # when the framework's step reduces them itself (tf.distribute, JAX).
    reduces_in_keras_dist: ClassVar[bool] = False
    # True when every process of a job builds the model (one copy per process): the
    # strategy then starts at `import keras_dist` and all processes take the chief's
    # random seed (`keras_dist.startup`), so weights made at any time agree.
    shares_random_seed: ClassVar[bool] = False
    # False when `run_loop` replaces Keras's fit/evaluate/predict loops with the
    # strategy's own (parameter servers), which then read epoch logs themselves.
    runs_keras_loops: ClassVar[bool] = True
    # Its processes' host-side collectives (one process: `SINGLE`, which does nothing).
    collectives: Collectives = SINGLE

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        self.environment = environment or LocalEnvironment()
        self.settings = chosen or Settings()
        self.step_timeout = timeouts.policy(self.settings)

    @classmethod
    def applied_step_timeout(cls, policy: timeouts.StepTimeout) -> tuple[str, str, str] | None:
        """How long this backend's processes wait for the others under `policy`: when joining
        the job, in the first steps and in later ones (docs/settings.md tabulates it); None
        where one process trains alone. A strategy that cannot apply part of a policy the user
        chose says so in one line when it starts."""
        return None

    @classmethod
    def detect(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> bool:
        """Whether the process was started by a launcher this strategy trains under.

        `detected`: the cluster environment read from `environ` (`environments.detect`).
        """
        return False

    @classmethod
    def cluster_environment(cls, environ: Mapping[str, str], detected: ClusterEnvironment) -> ClusterEnvironment:
        """This process's place in its job: `detected`, the launcher's that started it, unless
        this strategy reads its own from `environ`."""
        return detected

    @classmethod
    def process_variables(cls, environment: ClusterEnvironment, chosen: Settings) -> dict[str, str]:
        """The environment variables this backend's framework must find set when it starts
        (thread pools, timeouts, its server's address), asked at `import keras_dist` for the
        chosen strategy, which `keras_dist.startup` sets (`settings.export`); a variable the
        user set (in `chosen.variables`) is left alone."""
        return {}

    @classmethod
    def prepare_process(cls, environment: ClusterEnvironment, chosen: Settings) -> None:
        """Called at `import keras_dist` for the chosen strategy once its `process_variables`
        are set, before the script builds anything: the place for what the framework does
        once per process (a process group, a TensorFlow server, the local GPU)."""

    # --- topology -------------------------------------------------------------
    @property
    def rank(self) -> int:
        """This process's index among `size` processes, as its collectives number them."""
        return self.collectives.rank

    @property
    def size(self) -> int:
        return self.collectives.size

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
    def replicas_per_process(self) -> int:
        """Replicas fed by one process: its input batch is this times the script's."""
        return self.num_replicas // self.size

    @property
    def input_plan(self) -> InputPlan:
        """How this process reads the script's inputs (default: one shard per process)."""
        return InputPlan(num_shards=self.size, shard_index=self.rank, batch_multiplier=self.replicas_per_process)

    def take_input(self, x: Any, equal_steps: bool) -> Any:
        """What Keras reads for this process's split input `x` (default: `x` itself).

        `equal_steps`: every process's `x` is known to give the same number of batches of
        the same sizes (a padded training shard).
        """
        return x

    # --- model and optimizer --------------------------------------------------
    def scope(self) -> contextlib.AbstractContextManager[Any]:
        """Context under which the model's and optimizer's variables must be created."""
        return contextlib.nullcontext()

    def compile_defaults(self) -> dict:
        """`model.compile` arguments this backend needs unless the user gave them."""
        return {}

    def compile_arguments(self, kwargs: dict) -> dict:
        """The keyword arguments `model.compile` gets: the script's, over `compile_defaults`."""
        return {**self.compile_defaults(), **kwargs}

    def prepare_model(self, model: "keras.Model") -> "keras.Model":
        """Returns the model to train (the same object unless variables had to move)."""
        return model

    def process_local_steps(self, model: "keras.Model") -> contextlib.AbstractContextManager[None]:
        """Context in which `evaluate` and `predict` run: where the backend's steps are
        global computations, it makes them run on this process's shard alone."""
        return contextlib.nullcontext()

    def run_loop(self, method: str, model: "keras.Model", keras_method: Callable[..., Any], arguments: dict) -> Any:
        """Runs `model.fit`, `evaluate` or `predict` (`method`) with this worker's arguments.

        The default is Keras's own loop (`keras_method`). A backend whose steps Keras
        cannot drive (parameter servers: the chief schedules each step on a remote
        worker) runs its own loop here, with the same arguments and callbacks.
        """
        return keras_method(**arguments)

    def distribute_optimizer(self, optimizer: "keras.optimizers.Optimizer", options: GradientOptions) -> None:
        """Makes `optimizer` reduce gradients across replicas before each update."""

    def sum_across_processes_in_step(self, tensors: Sequence[Any]) -> Sequence[Any]:
        """Sums a list of tensors over processes inside a train step (a `tf.function`, or an eager torch step)."""
        return tensors

    # --- host-side collectives (eager, outside the train step): `self.collectives` -------
    def allgather_object(self, obj: Any) -> list:
        """Every process's `obj`, in rank order, on every process."""
        return self.collectives.allgather_object(obj)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.collectives.broadcast_object(obj, root)

    def broadcast_variables(self, variables: Sequence["keras.Variable"], root: int = 0) -> None:
        """Overwrites `variables` on every process with their values on `root`."""
        self.collectives.broadcast_variables(variables, root)

    def allgather_array(self, array: np.ndarray) -> np.ndarray:
        """Concatenates NumPy arrays of possibly different lengths, in rank order."""
        return self.collectives.allgather_array(array)

    def sum_arrays(self, arrays: Sequence[Any]) -> list[np.ndarray]:
        """Each NumPy array summed over processes (same shapes on every process), as a list."""
        return self.collectives.sum_arrays(arrays)

    def global_metric_states(self, variables: Sequence["keras.Variable"]) -> list:
        """The values of metric state `variables` over every process's batches, as NumPy arrays.

        By default each process holds its own share, summed here on the host.
        """
        import keras

        return self.sum_arrays([keras.ops.convert_to_numpy(v.value) for v in variables])

    def assign_metric_states(self, variables: Sequence["keras.Variable"], global_states: Sequence[np.ndarray]) -> None:
        """Sets metric state `variables` so that their sum over processes is `global_states`
        (`global_metric_states` inverted, to resume an epoch): the chief holds them, by
        default, the others zero."""
        for variable, value in zip(variables, global_states):
            variable.assign(value if self.is_chief else np.zeros_like(value))

    def barrier(self) -> None:
        self.collectives.barrier()

    def chief_file_callback(self, callback: "keras.callbacks.Callback") -> "keras.callbacks.Callback":
        """A checkpoint or log callback as the chief runs it."""
        return callback

    def worker_file_callback(self, callback: "keras.callbacks.Callback") -> "keras.callbacks.Callback | None":
        """What a worker other than the chief runs for a checkpoint or log callback: None
        (the default) to drop it, or a callback that takes part in collective saves
        without writing the user's files."""
        return None

    def describe(self) -> dict:
        return {"backend": self.name, "rank": self.rank, "size": self.size,
                "local_rank": self.local_rank, "num_replicas": self.num_replicas, **self.collectives.describe()}
