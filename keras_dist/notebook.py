"""`keras_dist.notebook_launcher`: N fresh processes from a running notebook kernel.

A notebook cannot run `keras-dist launch` on itself, and must not fork: its kernel may
have initialised CUDA, XLA or TensorFlow. Here the function and its arguments are
serialized by value (cloudpickle, so functions and classes defined in cells travel),
and the backend's own local launcher starts N new Python processes
(`strategies.local_cluster`, `processes.run_tasks`), each running
`keras_dist/launchers/notebook_task.py`. A front, like `keras_dist.cli`: it picks the
launcher through the strategies' registry. The chief's output streams into the cell as it
is printed; the first failure raises in the kernel with its rank and first line; an
interrupt (the notebook's stop button) stops every task by its process group.
"""

import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any, TextIO

from keras_dist.errors import KerasDistError
from keras_dist.launchers.notebook_task import ERROR, PAYLOAD, RESULT


class _ChiefLines:
    """The tasks' output as the cell shows it: the chief's lines without their prefix, and
    the launcher's own; every task's, prefixed, with `all_output`."""

    def __init__(self, out: TextIO, chief_prefix: str, all_output: bool) -> None:
        self.out, self.chief_prefix, self.all_output = out, chief_prefix, all_output

    def write(self, text: str) -> None:
        if self.all_output or text.startswith("[keras-dist]"):
            self.out.write(text)
        elif text.startswith(self.chief_prefix):
            self.out.write(text[len(self.chief_prefix):])

    def flush(self) -> None:
        self.out.flush()


def notebook_launcher(function: Callable[..., Any], args: tuple = (), num_processes: int = 2,
                      backend: str | None = None, all_output: bool = False) -> Any:
    """Runs `function(*args)` in `num_processes` new processes, one cluster; returns the chief's result.

    Call it from a notebook cell, with the training code (model, `keras_dist.compile`,
    `fit`) inside `function`, as the script of `keras-dist launch` would run it.

    Args:
        function: what every process runs; defined in the notebook or imported.
        args: its arguments (pickled by value; NumPy arrays are fine).
        num_processes: the processes, one replica each on CPUs (as `keras-dist launch -n`).
        backend: the keras_dist backend; default as `keras-dist launch` chooses it from
            the Keras backend this kernel runs (`jax`, `torch`, else `horovod`).
        all_output: show every process's lines, prefixed with its rank (default: the chief's).

    Returns:
        What `function` returned on the chief (rank 0).

    Raises:
        KerasDistError: a process failed: its rank and the first line of its error.
        KeyboardInterrupt: the kernel was interrupted; every process has been stopped.

    Example:

    ```python
    def train(epochs):
        model = make_model()
        keras_dist.compile(model, optimizer="adam", loss="mse")
        return model.fit(x, y, epochs=epochs).history

    history = keras_dist.notebook_launcher(train, args=(3,), num_processes=2)
    ```
    """
    import cloudpickle
    import keras

    from keras_dist import strategies
    from keras_dist.launchers.processes import INTERRUPTED, run_tasks

    if num_processes < 1:
        raise KerasDistError(f"num_processes must be at least 1, got {num_processes}")
    keras_backend = keras.backend.backend()
    backend = backend or (keras_backend if keras_backend in ("jax", "torch") else "horovod")
    task_script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "launchers", "notebook_task.py")
    with tempfile.TemporaryDirectory(prefix="keras_dist_notebook_") as directory:
        with open(os.path.join(directory, PAYLOAD), "wb") as f:
            cloudpickle.dump((function, tuple(args)), f)
        tasks = strategies.local_cluster(backend, num_processes, 0, [task_script, directory])
        for task in tasks:
            task.env.setdefault("KERAS_BACKEND", keras_backend)
        prefix = f"[{tasks[0].name}] " if tasks[0].prefix_output else "[0]<stdout>:"  # horovodrun's own prefix
        code = run_tasks(tasks, out=_ChiefLines(sys.stdout, prefix, all_output)).exit_code
        if code in INTERRUPTED:
            raise KeyboardInterrupt(f"keras_dist.notebook_launcher: interrupted; the {len(tasks)} tasks were stopped")
        if code != 0:
            raise KerasDistError(_first_error(directory, num_processes, code))
        with open(os.path.join(directory, RESULT), "rb") as f:
            return pickle.load(f)


def _first_error(directory: str, num_processes: int, code: int) -> str:
    """The failure written first: the others are often its consequence (a peer's collective that lost it)."""
    written = [(os.stat(path).st_mtime_ns, rank, path) for rank in range(num_processes)
               for path in [os.path.join(directory, ERROR.format(rank=rank))] if os.path.exists(path)]
    if not written:
        return f"a process exited with {code} before its function ran; pass all_output=True to see every process's output"
    _, rank, path = min(written)
    with open(path) as f:
        return f"rank {rank} failed: {f.read().strip()}"
