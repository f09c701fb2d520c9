"""The input matrix (tests/workers/input_matrix.py), one process per Keras backend.

Structures (arrays, lists, tuples, dicts, nested; y and sample_weight as structures;
pandas, scipy sparse, each backend's tensors) x sizes (0, 1, 2, 3, 4, 7) x processes
(1, 2, 3) x purposes (fit with `validation_split`, fit with `validation_data`, evaluate,
predict), each rank's split made as that rank would make it; Keras then runs every
rank's share for one size. The real launches of the same paths are the
`seeded_structured_inputs` pattern of tests/test_keras_guides.py.
"""

import json

import pytest

from runner import PYTHON, WORKERS, run

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("keras_backend", ["jax", "torch", "tensorflow"])
def test_every_structure_and_size_splits_as_one_process_reads_it(keras_backend):
    pytest.importorskip(keras_backend)
    code, output = run([PYTHON, WORKERS / "input_matrix.py"], 240, {"KERAS_BACKEND": keras_backend})
    assert code == 0, output[-5000:]
    report = json.loads(output.strip().splitlines()[-1])
    assert report["backend"] == keras_backend
    assert report["cases"] > 600, report["cases"]
    assert not report["failures"], "\n".join(report["failures"][:40])
