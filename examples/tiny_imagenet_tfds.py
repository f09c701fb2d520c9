"""A tiny stand-in for ImageNet in TFDS's format, made offline.

`prepare(data_dir)` writes a few random JPEGs of uneven sizes as TFDS's `imagenet2012`
(same name, version and features), so `tfds.load("imagenet2012", data_dir=data_dir)`
reads them with TFDS's own ImageNet builder. `examples/resnet50_imagenet.py --data-dir
DATA_DIR` then runs its ImageNet input path as on the real data set, which no test can
fetch (TFDS prepares it only from ImageNet's archives, downloaded by hand).
"""

import numpy as np
import tensorflow_datasets as tfds

IMAGENET = tfds.builder_cls("imagenet2012")


class TinyImagenet(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Random images labelled with 2 of ImageNet's 1000 classes."""

    name = "imagenet2012"  # written where TFDS looks for ImageNet; not registered, so no clash
    VERSION = IMAGENET.VERSION

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "image": tfds.features.Image(encoding_format="jpeg"),
                "label": tfds.features.ClassLabel(num_classes=1000),
                "file_name": tfds.features.Text(),
            }),
            supervised_keys=("image", "label"),
        )

    def _split_generators(self, dl_manager):
        return {"train": self._generate_examples(8, seed=0), "validation": self._generate_examples(4, seed=1)}

    def _generate_examples(self, count, seed):
        rng = np.random.default_rng(seed)
        for index in range(count):
            height, width = rng.integers(40, 80, size=2)
            image = rng.integers(0, 256, size=(height, width, 3), dtype=np.uint8)
            yield index, {"image": image, "label": index % 2, "file_name": f"tiny_{index}.JPEG"}


def prepare(data_dir):
    TinyImagenet(data_dir=data_dir).download_and_prepare()
