"""A TFDS dataset builder for the synthetic images of synthetic_data.py.

It lets the TFDS path be exercised offline: `prepare(data_dir)` writes the dataset in
TFDS's own format, after which `tfds.load("synthetic_images", data_dir=data_dir)` reads it
like any downloaded TFDS dataset (registered on import of this module).
"""

import os
import sys

import numpy as np
import tensorflow_datasets as tfds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from synthetic_data import NUM_CLASSES, SHAPE, load_data  # noqa: E402


class SyntheticImages(tfds.core.GeneratorBasedBuilder):
    """10 classes of 28x28 grayscale images, generated locally."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict(
                {"image": tfds.features.Tensor(shape=SHAPE, dtype=np.float32),
                 "label": tfds.features.ClassLabel(num_classes=NUM_CLASSES)}
            ),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        (x_train, y_train), (x_test, y_test) = load_data(num_train=2048, num_test=512)
        return {"train": self._generate_examples(x_train, y_train), "test": self._generate_examples(x_test, y_test)}

    def _generate_examples(self, images, labels):
        for index, (image, label) in enumerate(zip(images, labels)):
            yield index, {"image": image, "label": int(label)}


def prepare(data_dir):
    SyntheticImages(data_dir=data_dir).download_and_prepare()
