"""`keras_dist.notebook_launcher` in a real Jupyter kernel (nbclient runs the notebook's cells).

Each Keras backend trains 2 processes from a cell, twice in one kernel, and returns the
chief's history; the chief's lines, and only the chief's, reach the cell. A failure on
rank 1 raises in the kernel with its rank and first line. An interrupt (what the
notebook's stop button sends) ends every task, by its process group, within seconds.
"""

import json
import os
import time

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError

from keras_dist.launchers.processes import process_ended
from runner import QUIET_ENV, ROOT

pytestmark = pytest.mark.timeout(600)

TRAIN = '''
import json, os
import keras, numpy as np
import keras_dist

def train(epochs, fail_on=None):
    import keras, numpy as np
    import keras_dist
    rank = keras_dist.init().rank
    if rank == fail_on:
        raise ValueError(f"no data on rank {rank}")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = x.sum(axis=1, keepdims=True)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.05), loss="mse")
    history = model.fit(x, y, batch_size=8, epochs=epochs, verbose=2)
    return {"rank": rank, "size": keras_dist.current().size, "loss": history.history["loss"]}
'''


def execute(tmp_path, keras_backend, cells, timeout=240, **options):
    """Runs `cells` (sources, or a notebook) in a fresh kernel on `keras_backend`; returns the notebook with its outputs."""
    notebook = cells if isinstance(cells, nbformat.NotebookNode) else \
        nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source) for source in cells])
    saved = {k: os.environ.get(k) for k in (*QUIET_ENV, "KERAS_BACKEND")}
    os.environ.update({**QUIET_ENV, "KERAS_BACKEND": keras_backend})
    try:
        client = NotebookClient(notebook, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(tmp_path)}}, **options)
        client.execute()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    return notebook


def text(cell):
    return "".join(output.get("text", "") for output in cell.outputs if output.output_type == "stream")


@pytest.mark.parametrize("keras_backend", ["jax", "torch", "tensorflow"])
def test_a_cell_trains_two_processes_twice_and_a_failure_raises_in_the_kernel(tmp_path, keras_backend):
    pytest.importorskip("tensorflow" if keras_backend == "tensorflow" else keras_backend)
    notebook = execute(tmp_path, keras_backend, [
        TRAIN,
        "print('RESULT', json.dumps(keras_dist.notebook_launcher(train, args=(2,), num_processes=2)))",
        "print('RESULT', json.dumps(keras_dist.notebook_launcher(train, args=(1,), num_processes=2)))",
        "try:\n    keras_dist.notebook_launcher(train, args=(1, 1), num_processes=2)\n"
        "except keras_dist.KerasDistError as error:\n    print('ERROR', error)",
    ])
    first, second, failed = (text(cell) for cell in notebook.cells[1:])
    results = [json.loads(out.split("RESULT ", 1)[1]) for out in (first, second)]
    assert [(r["rank"], r["size"], len(r["loss"])) for r in results] == [(0, 2, 2), (0, 2, 1)]
    assert "Epoch 1/2" in first and "Epoch 2/2" in first, first
    assert "[rank:1]" not in first and "[worker:1]" not in first, first  # the chief's lines only
    assert "ERROR rank 1 failed: ValueError: no data on rank 1" in failed, failed


def test_the_example_notebook_runs(tmp_path):
    pytest.importorskip("jax")
    notebook = execute(tmp_path, "jax", nbformat.read(ROOT / "examples" / "notebook.ipynb", as_version=4))
    accuracy = notebook.cells[-1].outputs[-1]["data"]["text/plain"]
    assert accuracy.startswith("[") and len(accuracy.split(",")) == 3, accuracy


def test_an_interrupt_stops_every_process(tmp_path):
    pytest.importorskip("jax")
    cells = [
        "import os, time\nimport keras_dist\n"
        f"def wait():\n    open(os.path.join({str(tmp_path)!r}, f'pid-{{os.getpid()}}'), 'w').close()\n"
        "    time.sleep(600)",
        "keras_dist.notebook_launcher(wait, num_processes=2)",
    ]
    started = time.monotonic()
    # The cell's time out interrupts the kernel, as the notebook's stop button does.
    with pytest.raises((CellExecutionError, CellTimeoutError)):
        execute(tmp_path, "jax", cells, timeout=20, interrupt_on_timeout=True)
    pids = [int(name.split("-")[1]) for name in os.listdir(tmp_path) if name.startswith("pid-")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(process_ended(pid) for pid in pids):
        time.sleep(0.2)
    assert all(process_ended(pid) for pid in pids), pids
    assert time.monotonic() - started < 120
