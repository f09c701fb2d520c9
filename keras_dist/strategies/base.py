"""The strategy interface: how Keras 3 trains on N replicas, whatever launched the processes.

A strategy is an engine adapter: it sets its framework up in the process, builds the
model under it and combines gradients; compile and `fit`'s wrapping (`keras_dist.training`)
talk to it through this class. What the rooms under it receive (input, callbacks, fault
tolerance, the console) is the smaller `keras_dist.replicas.Replicas`, which every strategy
implements. A new strategy is one module beside the others plus one line in
`keras_dist.strategies.REGISTRY`. Who a process is comes from its cluster
environment (`keras_dist.environments`); what starts a local cluster is a launcher
(`keras_dist.launchers`), which the strategy's registry entry names.

Three families fit behind it:

* process-per-replica strategies (Horovod, PyTorch): every process holds a full copy of
  the model; keras_dist all-reduces gradients and metric states itself.
* `tf.distribute` strategies: TensorFlow replicates variables and reduces gradients and
  metrics inside Keras's step; keras_dist hands out `scope()` and splits the inputs.
* one computation over every process's devices (JAX): XLA reduces inside the step.
"""

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from keras_dist import timeouts
from keras_dist.collectives import SINGLE, Collectives
from keras_dist.environments import ClusterEnvironment, LocalEnvironment
from keras_dist.replicas import MetricStates, Replicas
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
        shard: `None`, `"optimizer"`: each process keeps the optimizer's state for its
            share of the variables only (`keras_dist.optimizer_sharding`), or `"weights"`:
            the model's weights are split over the processes too, during fit.
    """

    reduction: str = "mean"
    compression: str | None = None
    shard: str | None = None


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


class ProcessSetup:
    """What an engine needs of its process before any strategy exists, as class methods.

    Strategy selection, `keras-dist info` and `import keras_dist` ask them without making a
    strategy: whether the launcher that started the process is this backend's, the job as
    the backend reads it, the framework variables to set, the once-per-process start, and
    how long the backend's processes wait for each other. A strategy names its own
    (`Strategy.process_setup`); this one is a one-process backend's.
    """

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


class Strategy(Replicas):
    """One way of running a Keras 3 model on several replicas.

    keras_dist calls the strategy a process runs its *backend*: `keras_dist.init(backend=...)`
    and `KERAS_DIST_BACKEND` pick one by `name`. Topology, host collectives, the input
    plan and the engine's parts are `Replicas`'s: `collectives`, `metric_states`
    (`MetricStates`), `checkpoint_io` (`CheckpointIO`), each made in `__init__`, and the
    class-level `process_setup` (`ProcessSetup`), asked before any strategy exists.

    Args:
        environment: this process's place in its job, as its launcher set it
            (`process_setup.cluster_environment`), kept as `environment`. Single-process strategies keep
            `rank` 0 and `size` 1 whatever it says.
        chosen: keras_dist's settings, read once (`keras_dist.settings`), kept as
            `settings`; framework variables are read in their `variables`, and the step
            timeout is built from them once (`step_timeout`). A strategy reads no
            environment variable itself. None: the defaults (tests).
    """

    # True when Keras's step computes gradients and metric states from this process's
    # batches alone, and keras_dist's hooks must reduce them (Horovod, PyTorch); False
    # when the framework's step reduces them itself (tf.distribute, JAX).
    reduces_in_keras_dist: ClassVar[bool] = False
    # True when every process of a job builds the model (one copy per process): the
    # strategy then starts at `import keras_dist` and all processes take the chief's
    # random seed (`keras_dist.startup`), so weights made at any time agree.
    shares_random_seed: ClassVar[bool] = False
    # True when `distribute_optimizer` takes `GradientOptions.shard="optimizer"`.
    shards_optimizer_state: ClassVar[bool] = False
    # True when it also takes `GradientOptions.shard="weights"`.
    shards_weights: ClassVar[bool] = False
    # False when `run_loop` replaces Keras's fit/evaluate/predict loops with the
    # strategy's own (parameter servers), which then read epoch logs themselves.
    runs_keras_loops: ClassVar[bool] = True
    # Its processes' host-side collectives (one process: `SINGLE`, which does nothing).
    collectives: Collectives = SINGLE
    # `model.compile` arguments this backend needs unless the script gives them.
    compile_defaults: ClassVar[Mapping[str, Any]] = {}
    # What it needs of the process before it exists (`ProcessSetup`'s class methods).
    process_setup: ClassVar[type[ProcessSetup]] = ProcessSetup

    def __init__(self, environment: ClusterEnvironment | None = None, chosen: Settings | None = None):
        self.environment = environment or LocalEnvironment()
        self.settings = chosen or Settings()
        self.step_timeout = timeouts.policy(self.settings)
        from keras_dist.fault_tolerance.checkpoint_io import CheckpointIO  # imports Keras

        # The chief writes, the others drop file callbacks; engines that save otherwise declare how.
        self.checkpoint_io = CheckpointIO()
        self.metric_states = MetricStates(self)

    # --- topology: the job's, as its collectives number the processes ---------
    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def size(self) -> int:
        return self.collectives.size

    # --- model and optimizer --------------------------------------------------
    def compile_arguments(self, kwargs: dict) -> dict:
        """The keyword arguments `model.compile` gets: the script's, over `compile_defaults`."""
        return {**self.compile_defaults, **kwargs}

    def prepare_model(self, model: "keras.Model") -> "keras.Model":
        """Returns the model to train (the same object unless variables had to move)."""
        return model

    def run_loop(self, method: str, model: "keras.Model", keras_method: Callable[..., Any], arguments: dict) -> Any:
        """Runs `model.fit`, `evaluate` or `predict` (`method`) with this worker's arguments.

        The default is Keras's own loop (`keras_method`). A backend whose steps Keras
        cannot drive (parameter servers: the chief schedules each step on a remote
        worker) runs its own loop here, with the same arguments and callbacks.
        """
        return keras_method(**arguments)

    def distribute_optimizer(self, optimizer: "keras.optimizers.Optimizer", options: GradientOptions) -> None:
        """Makes `optimizer` reduce gradients across replicas before each update."""

    def describe(self) -> dict:
        return {**super().describe(), **self.collectives.describe()}
