"""The bench's CNN, shared by bench/worker.py (TensorFlow) and bench/backend_worker.py (JAX, PyTorch)."""

import keras

CNN_INPUT, CNN_BATCH, CNN_STEPS = (32, 32, 3), 64, 20  # input shape, batch per replica, batches per epoch


def cnn_layers() -> list:
    return [keras.layers.Conv2D(32, 3, activation="relu"), keras.layers.Conv2D(64, 3, activation="relu"),
            keras.layers.MaxPooling2D(), keras.layers.Conv2D(64, 3, activation="relu"), keras.layers.MaxPooling2D(),
            keras.layers.Flatten(), keras.layers.Dense(172, activation="relu"), keras.layers.Dense(10)]
