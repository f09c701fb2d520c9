"""Distributed training of a small CNN on synthetic images (see synthetic_data.py).

    keras-dist launch --backend horovod -n 2 examples/train_distributed.py

It is examples/train.py with two lines changed: `import keras_dist`, and
`model.compile(` became `keras_dist.compile(model,`. Batch size 64 is per replica.
"""

import os
import sys

import keras
import keras_dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_data import NUM_CLASSES, SHAPE, load_data  # noqa: E402

EPOCHS = int(os.environ.get("EPOCHS", "3"))
OUTPUT = os.environ.get("OUTPUT", "/tmp/keras_dist_example")

keras.utils.set_random_seed(42)
(x_train, y_train), (x_test, y_test) = load_data()

model = keras.Sequential(
    [
        keras.Input(SHAPE),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Flatten(),
        keras.layers.Dense(NUM_CLASSES),
    ]
)
keras_dist.compile(model,
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
callbacks = [
    keras.callbacks.ModelCheckpoint(os.path.join(OUTPUT, "best.keras"), save_best_only=True),
    keras.callbacks.BackupAndRestore(os.path.join(OUTPUT, "backup")),
    keras.callbacks.TensorBoard(os.path.join(OUTPUT, "tensorboard")),
    keras.callbacks.CSVLogger(os.path.join(OUTPUT, "log.csv")),
]
model.fit(x_train, y_train, batch_size=64, epochs=EPOCHS, validation_split=0.1, callbacks=callbacks, verbose=2)
loss, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
print(f"test accuracy: {accuracy:.4f}  test loss: {loss:.4f}")
