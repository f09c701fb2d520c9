"""Distributed training from a TFDS dataset.

    keras-dist launch --backend horovod -n 2 examples/tfds_classifier.py DATA_DIR [DATASET]

DATASET defaults to "synthetic_images", which examples/synthetic_tfds.py builds locally
(no download); any image-classification dataset already in DATA_DIR works the same way.
keras_dist splits the dataset across replicas (element i to replica i mod N), so it is
read in full by every process and batched per replica.
"""

import os
import sys

import keras
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_tfds  # noqa: E402,F401  (registers "synthetic_images")

data_dir = sys.argv[1]
name = sys.argv[2] if len(sys.argv) > 2 else "synthetic_images"
epochs = int(os.environ.get("EPOCHS", "2"))
batch_size = int(os.environ.get("BATCH_SIZE", "32"))  # per replica

(train, test), info = tfds.load(name, split=["train", "test"], data_dir=data_dir, as_supervised=True, with_info=True,
                                download=False)
train = train.map(lambda x, y: (tf.cast(x, "float32"), y)).batch(batch_size)
test = test.map(lambda x, y: (tf.cast(x, "float32"), y)).batch(128)

keras.utils.set_random_seed(0)
model = keras.Sequential([
    keras.Input(info.features["image"].shape),
    keras.layers.Flatten(),
    keras.layers.Dense(64, activation="relu"),
    keras.layers.Dense(info.features["label"].num_classes),
])
keras_dist.compile(model, optimizer=keras.optimizers.SGD(0.05),
                   loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
model.fit(train, epochs=epochs, verbose=2)
loss, accuracy = model.evaluate(test, verbose=0)
print(f"test accuracy: {accuracy:.4f}  test loss: {loss:.4f}  weights checksum: {sum(float(abs(w).sum()) for w in model.get_weights()):.6f}")
