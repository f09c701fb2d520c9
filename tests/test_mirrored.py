"""MirroredStrategy backend: 2 logical CPU devices in a subprocess (no GPU needed)."""

import os

import pytest

import runner


pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def single_at_16(tmp_path_factory):
    # 72 samples: the last step is partial; 17 evaluation samples: a partial last batch.
    return runner.train(tmp_path_factory.mktemp("single"), "single", "--batch", 16, "--samples", 72,
                        "--eval-samples", 17)[0]


def test_two_replicas_at_batch_8_match_one_process_at_16(tmp_path, single_at_16):
    (mirrored,) = runner.train(tmp_path, "mirrored", "--cpus", 2, "--batch", 8, "--samples", 72, "--eval-samples", 17)
    assert mirrored["describe"]["num_replicas"] == 2
    runner.assert_trains_like(mirrored, single_at_16)


def test_a_dataset_batch_is_per_replica(tmp_path, single_at_16):
    # A dataset batched at 8 feeds each of the 2 replicas 8 examples a step, like batch_size=8.
    (mirrored,) = runner.train(tmp_path, "mirrored", "--cpus", 2, "--batch", 8, "--samples", 72, "--eval-samples", 17,
                               "--dataset")
    runner.assert_trains_like(mirrored, single_at_16)


@pytest.mark.parametrize("kind", ["functional", "subclassed"])
def test_functional_and_subclassed_models_built_before_compile_train_alike(tmp_path, kind):
    args = ("--samples", 72, "--eval-samples", 17, "--model", kind)
    (single,) = runner.train(tmp_path / "single", "single", "--batch", 16, *args)
    (mirrored,) = runner.train(tmp_path / "mirrored", "mirrored", "--cpus", 2, "--batch", 8, *args)
    runner.assert_trains_like(mirrored, single)  # re-initialized variables would end elsewhere


def test_steps_per_execution_2_gives_the_same_weights(tmp_path, single_at_16):
    (mirrored,) = runner.train(tmp_path, "mirrored", "--cpus", 2, "--batch", 8, "--samples", 72, "--eval-samples", 17,
                               "--steps-per-execution", 2)
    runner.assert_trains_like(mirrored, single_at_16)


def test_upstream_keras_19246_still_fails():
    """Fails once Keras fixes keras-team/keras#19246: then drop the loop workaround."""
    ((code, out),) = runner.run_python([[os.path.join(os.path.dirname(runner.WORKER), "plain_keras.py"), "mirrored-spe"]], [{}])
    assert code == 0, out[-2000:]
    assert "You must feed a value for placeholder tensor" in out, out[-2000:]


def test_upstream_keras_model_without_call_still_fails_under_a_strategy():
    """Fails once Keras stops building a model without call() from a batch under a strategy
    (keras-team/keras#19969, #20045): then drop that case from `build_from_local_batch`."""
    ((code, out),) = runner.run_python([[os.path.join(os.path.dirname(runner.WORKER), "plain_keras.py"), "mirrored-no-call"]],
                                [{}])
    assert code == 0, out[-2000:]
    assert "ERROR:" in out and "does not have a `call()` method" in out, out[-2000:]


def test_detection_reads_only_the_environment():
    assert runner.selected_backend({"CUDA_VISIBLE_DEVICES": "0,1"}) == "mirrored"
    assert runner.selected_backend({"CUDA_VISIBLE_DEVICES": "0"}) == "single"
    assert runner.selected_backend({"CUDA_VISIBLE_DEVICES": "-1"}) == "single"


def test_gradient_compression_is_refused_in_one_line():
    # tf.distribute would send the gradients uncompressed: say so rather than ignore it.
    script = ("import tensorflow as tf\n"
              "tf.config.set_logical_device_configuration(tf.config.list_physical_devices('CPU')[0],\n"
              "                                           [tf.config.LogicalDeviceConfiguration()] * 2)\n"
              "import keras, keras_dist\n"
              "keras_dist.init(backend='mirrored')\n"
              "model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])\n"
              "keras_dist.compile(model, optimizer='sgd', loss='mse', gradient_compression='fp16')\n")
    code, out = runner.run([runner.PYTHON, "-c", script], timeout=120)
    assert code != 0
    assert ("KerasDistError: backend 'mirrored' all-reduces gradients as they are; drop gradient_compression, "
            "or train under horovodrun to compress them") in out, out[-3000:]
