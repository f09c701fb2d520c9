"""Plain Keras under a tf.distribute strategy, to show an upstream bug still exists.

Usage: python plain_keras.py CASE, CASE one of:
  mwms-build     MultiWorkerMirroredStrategy fit (keras#20585, tensorflow#72388, build)
  mwms-reduce    the same with keras_dist's build fix only (keras#20585, log reduction)
  mirrored-spe   MirroredStrategy with steps_per_execution=2 (keras#19246)
  mirrored-no-call  MirroredStrategy fit of a Model subclass without call() (keras#19969, #20045)
  central-metrics  CentralStorageStrategy evaluate: loss against its mean over the data (keras#21054)
  central-dropout  CentralStorageStrategy fit of a model with Dropout (keras#20611)
Prints `ERROR: <message>` when Keras fails (raises, or returns a wrong loss), `OK` when it trains.
"""

import sys

import tensorflow as tf

case = sys.argv[1]
if case.startswith("mirrored-") or case.startswith("central-"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0], [tf.config.LogicalDeviceConfiguration()] * 2
    )
if case.startswith("mirrored-"):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
elif case.startswith("central-"):
    strategy = tf.distribute.experimental.CentralStorageStrategy(["/cpu:0", "/cpu:1"])
else:
    strategy = tf.distribute.MultiWorkerMirroredStrategy()

import numpy as np  # noqa: E402
import keras  # noqa: E402



class NoCall(keras.Model):
    """The shape of the TensorFlow guide's GAN: no call(), a train_step of its own."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((self.dense(x) - y) ** 2)
        self.optimizer.apply(tape.gradient(loss, self.dense.trainable_weights), self.dense.trainable_weights)
        return {"loss": loss}


with strategy.scope():
    dropout = [keras.layers.Dropout(0.5)] if case == "central-dropout" else []
    model = NoCall() if case == "mirrored-no-call" else keras.Sequential([keras.Input((4,)), *dropout,
                                                                          keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", steps_per_execution=2 if case == "mirrored-spe" else 1)
if case == "mwms-reduce":
    from keras_dist import keras_workarounds

    keras_workarounds.build_from_local_batch(model, strategy)
x = np.ones((32, 4), "float32")
try:
    if case == "central-metrics":
        x = np.arange(128, dtype="float32").reshape(32, 4)
        loss = model.evaluate(x, x[:, :1], batch_size=8, verbose=0)
        mean = float(np.mean((model.predict(x, verbose=0) - x[:, :1]) ** 2))
        if not np.isclose(loss, mean, rtol=1e-4):
            raise ValueError(f"evaluate gives loss {loss}, its mean over the data is {mean}")
    else:
        model.fit(x, x[:, :1], batch_size=8, epochs=1, verbose=0)
    print("OK")
except Exception as exc:  # the upstream bug: report its message
    print("ERROR:", " ".join(str(exc).split()))
