"""A small image-classification data set made on the spot: no download needed.

Each of the 10 classes is a fixed random 28x28 pattern; a sample is its class's pattern
under noise and a random brightness. A small network learns it to high accuracy in a few
epochs, which makes it a quick check that distributed training really trains.
"""

import numpy as np

NUM_CLASSES = 10
SHAPE = (28, 28, 1)


def load_data(num_train=8192, num_test=2048, seed=0):
    """Returns `(x_train, y_train), (x_test, y_test)` as float32 images and int labels."""
    rng = np.random.default_rng(seed)
    patterns = rng.uniform(0.0, 1.0, size=(NUM_CLASSES, *SHAPE)).astype("float32")

    def sample(count):
        labels = rng.integers(0, NUM_CLASSES, size=count)
        brightness = rng.uniform(0.6, 1.4, size=(count, 1, 1, 1)).astype("float32")
        noise = rng.normal(0.0, 0.6, size=(count, *SHAPE)).astype("float32")
        return patterns[labels] * brightness + noise, labels.astype("int32")

    return sample(num_train), sample(num_test)
