"""Models compiled without `keras_dist.compile`, distributed as if it had compiled them.

A script's first model gets the two-line change; the models it compiles afterwards often
do not: `keras.models.load_model` compiles the model it loads (TensorFlow's multi-worker
tutorial reloads and fits one), a teacher is compiled beside a student, a subclass's own
`compile` calls `super().compile()`. In a job of several processes each would train alone,
on all the data. So keras_dist notices every compile that Keras runs (`notice_compile`)
and gives that model a `fit`, on the object only, that first calls `keras_dist.compile`
with the arguments of the outermost `compile` call (the subclass's own ones, or Keras's
with the optimizer Keras made, whose state a load fills in after compiling), then runs
distributed; its `evaluate` and `predict` are distributed from then on too. Before its
first `fit` they run as in one process, with no collective: a script's
`if is_chief: load_model(best).predict(x)` stays the chief's alone. The chief says so in
one INFO line per model. `keras_dist.local(model)` keeps a model to each process, as plain
Keras.

Keras has no hook at `compile`, and keras_dist patches no Keras class. What it does see
is each variable Keras creates, and every compile creates some (its loss tracker's): on
JAX, Keras asks the global distribution for the variable's layout
(`CompiledElsewhereWatch.get_variable_layout`); on TensorFlow, TensorFlow calls the
variable creators of the thread (`tf.variable_creator_scope`, entered once). The compile
is then found on the stack, as `_model_whose_fit_runs` finds a fit. PyTorch calls nothing
of keras_dist's while Keras 3.15 compiles: there a model compiled elsewhere stops at its
`fit` in one line (`CompiledElsewhereWatch._is_multi_process`), as does one compiled in
another thread.
"""

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable, Iterator
from types import FrameType
from typing import TYPE_CHECKING, Any

import keras

from keras_dist import keras_internals, variable_creation
from keras_dist.errors import KerasDistError
from keras_dist.overrides import override, restore

if TYPE_CHECKING:
    from keras_dist.strategies.base import Strategy

logger = logging.getLogger("keras_dist")
_LOCAL: "weakref.WeakSet[keras.Model]" = weakref.WeakSet()
# The model `keras_dist.compile` is compiling (its own compile is not one "elsewhere").
_COMPILING_HERE: list[keras.Model] = []
# Kept alive for the process: TensorFlow pops a creator when its scope's generator is closed.
# `keras_dist.compile` and the strategy, given by the rooms above this one (`distribute_through`, `watch`).
_DISTRIBUTED_COMPILE: list[Callable[..., None]] = []
_STRATEGY: list["Strategy"] = []


def local(model: keras.Model) -> keras.Model:
    """Keeps `model` to each process, as plain Keras: its `fit` trains it alone on the data
    each process passes, and no compile distributes it. Returns the model.

    For the rare model that should differ per process (one process's own probe or
    baseline); every other model a job compiles trains distributed.
    """
    _LOCAL.add(model)
    restore(model)  # plain Keras methods, whether keras_dist distributed it already or not
    return model


@contextlib.contextmanager
def compiling_here(model: keras.Model) -> Iterator[None]:
    """Marks the compile `keras_dist.compile` runs on `model`."""
    _COMPILING_HERE.append(model)
    try:
        yield
    finally:
        _COMPILING_HERE.pop()


def distribute_through(compile_function: Callable[..., None]) -> None:
    """Names `keras_dist.compile`, which distributes the models compiled elsewhere."""
    _DISTRIBUTED_COMPILE[:] = [compile_function]


def watch(strategy: "Strategy") -> None:
    """In a job of several processes whose Keras loops keras_dist runs: sets
    `CompiledElsewhereWatch` as Keras's distribution and, on TensorFlow, watches the
    variables TensorFlow creates."""
    if strategy.size == 1 or not strategy.runs_keras_loops or keras.distribution.distribution() is not None:
        return
    _STRATEGY[:] = [strategy]
    keras.distribution.set_distribution(CompiledElsewhereWatch(strategy))
    if keras.backend.backend() == "tensorflow":
        variable_creation.watch(notice_compile)


def notice_compile() -> None:
    """If a variable is being created inside Keras's `compile` of a model keras_dist did not
    compile, makes that model's next `fit` distribute it first."""
    frame = _keras_compile_frame()
    if frame is None:
        return
    model = frame.f_locals.get("self")
    if model is None or model in _LOCAL or any(model is m for m in _COMPILING_HERE):
        return
    outermost, keras_own = _outermost_compile(frame, model)
    try:
        arguments = _call_arguments(outermost)
    except KeyError:  # the compile deleted an argument of its own: its call cannot be made again
        return  # (its fit stops in one line, `CompiledElsewhereWatch._is_multi_process`)
    override(model, "fit", _distributing_first(model, arguments, keras_own))


def _keras_compile_frame() -> FrameType | None:
    """The innermost frame of Keras's own `Trainer.compile` on the stack, if any."""
    target = keras_internals.compile_code()
    return _innermost_frame(lambda frame: frame.f_code is target)


def _innermost_frame(matches) -> FrameType | None:
    """The innermost frame of the stack, above this module's own two, for which `matches` holds."""
    frame = sys._getframe(3)
    while frame is not None and not matches(frame):
        frame = frame.f_back
    return frame


def _outermost_compile(frame: FrameType, model: keras.Model) -> tuple[FrameType, bool]:
    """The outermost `compile` of `model` on the stack (a subclass's own, which called
    `super().compile()`), and whether it is Keras's own."""
    outermost = frame
    caller = frame.f_back
    while caller is not None:
        if caller.f_code.co_name == "compile" and caller.f_locals.get("self") is model:
            outermost = caller
        caller = caller.f_back
    return outermost, outermost is frame


def _call_arguments(frame: FrameType) -> tuple[tuple, dict]:
    """The arguments a method's frame was called with, as they stand (less `self`): by name,
    but for those a `*args` follows."""
    code, values = frame.f_code, frame.f_locals
    names = code.co_varnames
    named = names[1:code.co_argcount + code.co_kwonlyargcount]
    index = code.co_argcount + code.co_kwonlyargcount
    positional: list = []
    keywords = {n: values[n] for n in named}
    if code.co_flags & inspect.CO_VARARGS:
        positional = [keywords.pop(n) for n in names[1:code.co_argcount]] + list(values[names[index]])
        index += 1
    if code.co_flags & inspect.CO_VARKEYWORDS:
        keywords.update(values[names[index]])
    return tuple(positional), keywords


def _distributing_first(model: keras.Model, arguments: tuple[tuple, dict], keras_own: bool):
    def fit(*args: Any, **kwargs: Any) -> Any:
        distribute(model, arguments, keras_own)
        return model.fit(*args, **kwargs)

    return fit


def distribute(model: keras.Model, arguments: tuple[tuple, dict], keras_own: bool) -> None:
    """`keras_dist.compile` of a model compiled elsewhere, with its compile's arguments and
    the gradient options keras_dist compiled it with before, if it did."""
    positional, keywords = arguments
    if keras_own:
        # The optimizer Keras made (or wrapped for loss scaling), whose state a load fills in.
        keywords = {**keywords, "optimizer": model.optimizer}
    before = vars(model).get("_keras_dist")
    if before is not None:
        options = before.gradient_options
        keywords = {**keywords, "gradient_reduction": options.gradient_reduction,
                    "gradient_compression": options.gradient_compression, "shard": options.shard}
    if _STRATEGY[0].is_chief:
        logger.info("keras_dist: distributing %s %r, which was compiled without keras_dist.compile (by "
                    "keras.models.load_model or model.compile); keras_dist.local(model) keeps a model to each process",
                    type(model).__name__, model.name)
    _DISTRIBUTED_COMPILE[0](model, *positional, **keywords)


class CompiledElsewhereWatch:
    """Keras's global distribution in a job of several processes (`watch`).

    Everything Keras asks of it leaves Keras as with no distribution, but for two
    questions. On JAX, a new variable's layout: there it notices compiles
    (`notice_compile`) and answers none. At the start of every `fit`, `evaluate` and
    `predict`, Keras's data adapter asks whether the distribution spans several processes
    (`_is_multi_process`): there it stops, in one line, the `fit` of a model compiled where
    keras_dist could not see it. Its tf.data adapter hands it the dataset (kept as it is:
    keras_dist splits inputs before Keras sees them), and a layer call asks for an output
    layout (none). On JAX, Keras also places each batch where this object says (on this
    process's first device, where variables without a layout are) and compiles each step
    for its variables' own placement; while a model keras_dist compiled runs `fit`, its
    strategy's distribution replaces this one. `evaluate` and `predict` of a model Keras
    runs itself (a local one, a sub-model cut out of a trained one) run as in one process.
    """

    auto_shard_dataset = False
    batch_dim_name = "batch"

    def __init__(self, strategy: "Strategy") -> None:
        self.strategy = strategy
        self._data_layouts: dict[int, keras.distribution.TensorLayout] = {}  # by the data's rank

    @property
    def _is_multi_process(self) -> bool:
        model = _model_whose_fit_runs()
        if model is not None and "_keras_dist" not in vars(model) and model not in _LOCAL:
            raise KerasDistError(
                f"fit of {type(model).__name__} {model.name!r}, which was compiled where keras_dist could not see it "
                f"({'on PyTorch' if keras.backend.backend() == 'torch' else 'in another thread'}): each of the "
                f"{self.strategy.size} processes would train it alone; call keras_dist.compile(model) before fit "
                "(without other arguments it keeps the model's optimizer, its state and its compile settings), or "
                "keras_dist.local(model) to train it alone on each process")
        return False

    def distribute_dataset(self, dataset: Any) -> Any:
        return dataset

    def get_tensor_layout(self, path: str) -> None:
        return None

    def get_variable_layout(self, variable: keras.Variable) -> None:
        notice_compile()
        return None

    def get_data_layout(self, data_shape: tuple) -> keras.distribution.TensorLayout:
        # Asked for every leaf of every batch (`train_on_batch`): one layout per rank, made once.
        rank = len(data_shape)
        if rank not in self._data_layouts:
            import jax

            device = keras.distribution.DeviceMesh((1,), [self.batch_dim_name], [jax.local_devices()[0]])
            self._data_layouts[rank] = keras.distribution.TensorLayout([self.batch_dim_name] + [None] * (rank - 1),
                                                                        device)
        return self._data_layouts[rank]


def _model_whose_fit_runs() -> keras.Model | None:
    """The model whose Keras `fit` is on the stack (the innermost), if any."""
    trainer = keras_internals.trainer_mixin()
    frame = _innermost_frame(lambda f: f.f_code.co_name == "fit" and isinstance(f.f_locals.get("self"), trainer))
    return None if frame is None else frame.f_locals["self"]
