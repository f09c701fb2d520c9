"""Every structure of arrays `fit` takes, under 2 processes on every Keras backend (issue 58).

tests/workers/array_structures.py runs its cells (list, tuple and dict x; no y, with a
custom `train_step` on TensorFlow and a loss against the inputs elsewhere; list and dict
y; sample_weight; class_weight; validation_split; shuffle True, False and "batch"; float64
arrays) in one launch per configuration: one plain process at the global batch (the
reference, per Keras backend), then `horovodrun` with 2 ranks and MultiWorkerMirrored with
2 workers on TensorFlow, `keras-dist launch -n 2` on JAX and `torchrun` with 2 processes on
PyTorch. Every cell must run, give `train_step` what Keras's own array adapter gives one
plain process (nesting and dtypes), and end where it does on both ranks.
tests/test_input_matrix.py checks the same structures in one process per Keras backend,
without launches.
"""

import pytest

from runner import WORKERS, configuration_command, load_results, run
from test_published_patterns import assert_close

pytestmark = pytest.mark.timeout(600)
SCRIPT = WORKERS / "array_structures.py"
CELLS = ["list_x", "list_x_unshuffled", "tuple_x", "dict_x", "list_y", "dict_y", "autoencoder_shuffle_True",
         "autoencoder_shuffle_False", "pair_autoencoder", "sample_weight", "class_weight"]
# Keras backend: the configurations (tests/runner.py) of 2 processes it runs under.
CONFIGURATIONS = {"tensorflow": ["horovod_2", "mwms_2"], "jax": ["launch_2"], "torch": ["torchrun_2"]}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """{(Keras backend, configuration): {cell: [result per rank]}}, one launch per
    configuration (and one plain process per Keras backend), one after another."""
    out = {}
    for keras_backend, configurations in CONFIGURATIONS.items():
        for name in ["plain_1", *configurations]:
            directory = tmp_path_factory.mktemp(f"{keras_backend}-{name}")
            argv = [SCRIPT, directory, "plain" if name == "plain_1" else "keras_dist", *CELLS]
            code, output = run(configuration_command(name, argv), 300, {"KERAS_BACKEND": keras_backend})
            assert code == 0, f"{keras_backend} {name}:\n{output[-5000:]}"
            ranks = 1 if name == "plain_1" else 2
            out[keras_backend, name] = {cell: load_results(directory, cell, ranks) for cell in CELLS}
    return out


@pytest.mark.parametrize("keras_backend, configuration",
                         [(backend, name) for backend, names in CONFIGURATIONS.items() for name in names])
@pytest.mark.parametrize("cell", CELLS)
def test_every_array_structure_trains_as_one_plain_process(results, keras_backend, configuration, cell):
    (reference,) = results[keras_backend, "plain_1"][cell]
    assert "error" not in reference and reference["seen"] is not None, reference
    first, second = results[keras_backend, configuration][cell]
    for rank, result in enumerate((first, second)):
        assert "error" not in result, f"rank {rank}: {result['error']}"
        assert result["seen"] == reference["seen"], f"rank {rank}: train_step got {result['seen']}"
        assert_close(result, reference, f"{configuration} rank {rank} {cell}")
    assert_close(second["weights"], first["weights"], f"{configuration} ranks", tolerance=0)
