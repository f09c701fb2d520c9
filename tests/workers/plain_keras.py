"""Plain Keras under a tf.distribute strategy, to show an upstream bug still exists.

Usage: python plain_keras.py CASE, CASE one of:
  mwms-build     MultiWorkerMirroredStrategy fit (keras#20585, tensorflow#72388, build)
  mwms-reduce    the same with keras_dist's build fix only (keras#20585, log reduction)
  mirrored-spe   MirroredStrategy with steps_per_execution=2 (keras#19246)
Prints `ERROR: <message>` when Keras fails, `OK` when it trains.
"""

import sys

import tensorflow as tf

case = sys.argv[1]
if case == "mirrored-spe":
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

import numpy as np  # noqa: E402
import keras  # noqa: E402

with strategy.scope():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2 if case == "mirrored-spe" else 1)
if case == "mwms-reduce":
    from keras_dist import keras_workarounds

    keras_workarounds.build_from_local_batch(model, strategy)
x = np.ones((32, 4), "float32")
try:
    model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    print("OK")
except Exception as exc:  # the upstream bug: report its message
    print("ERROR:", " ".join(str(exc).split()))
