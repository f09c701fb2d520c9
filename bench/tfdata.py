"""The tf.data workloads of bench/run.py: TFRecord files of JPEG images and the pipeline.

`ensure_records(directory)` writes FILES TFRecord files of EXAMPLES examples in all, once
(a later call finds them and returns): each example a 64x64x3 JPEG of a smooth random
image (random low-resolution colours upsampled, plus fine noise, so decoding does real
work) and an int64 label. `pipeline(directory)` is the input exactly as a user writes
it, unsharded:

    list_files(pattern, shuffle=False) -> TFRecordDataset
      -> map(parse, decode_jpeg, random_crop 56x56, random flip, scale; AUTOTUNE)
      -> batch(BATCH) -> prefetch(AUTOTUNE)

Only the hand-written reference loops pass `shard=(size, rank)`: rank r then reads
files[r::size], as a user who shards by hand does.
"""

import os
import shutil
import tempfile

import numpy as np
import tensorflow as tf

FILES = 16
EXAMPLES = 4096  # 256 per file: 2048 per worker of 2, whole batches everywhere
BATCH = 64
IMAGE = 64
CROP = 56
VERSION = "jpeg64-v1"  # change when the files written change
_COMPLETE = "COMPLETE"


def default_directory():
    return os.path.join(os.path.expanduser("~"), ".cache", "keras_dist", "bench", VERSION)


def ensure_records(directory):
    """Writes the TFRecord files into `directory` unless a complete set is there already."""
    if os.path.exists(os.path.join(directory, _COMPLETE)):
        return directory
    os.makedirs(os.path.dirname(directory), exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".staging-", dir=os.path.dirname(directory))
    rng = np.random.default_rng(0)
    per_file = EXAMPLES // FILES
    for f in range(FILES):
        with tf.io.TFRecordWriter(os.path.join(staging, f"train-{f:05d}-of-{FILES:05d}.tfrecord")) as writer:
            for _ in range(per_file):
                coarse = rng.random((1, 8, 8, 3), dtype=np.float32)
                smooth = tf.image.resize(coarse, (IMAGE, IMAGE), method="bicubic")[0].numpy()
                pixels = np.clip(smooth + rng.normal(0, 0.04, smooth.shape), 0, 1) * 255
                jpeg = tf.io.encode_jpeg(pixels.astype(np.uint8), quality=90).numpy()
                example = tf.train.Example(features=tf.train.Features(feature={
                    "image": tf.train.Feature(bytes_list=tf.train.BytesList(value=[jpeg])),
                    "label": tf.train.Feature(int64_list=tf.train.Int64List(value=[int(rng.integers(0, 10))])),
                }))
                writer.write(example.SerializeToString())
    open(os.path.join(staging, _COMPLETE), "w").close()
    try:
        os.rename(staging, directory)
    except OSError:  # another run finished first, or a partial set is in the way
        if not os.path.exists(os.path.join(directory, _COMPLETE)):
            shutil.rmtree(directory, ignore_errors=True)
            os.rename(staging, directory)
        else:
            shutil.rmtree(staging, ignore_errors=True)
    return directory


_FEATURES = {"image": tf.io.FixedLenFeature([], tf.string), "label": tf.io.FixedLenFeature([], tf.int64)}


def _preprocess(record):
    example = tf.io.parse_single_example(record, _FEATURES)
    image = tf.io.decode_jpeg(example["image"], channels=3)
    image = tf.image.random_crop(image, (CROP, CROP, 3))
    image = tf.image.random_flip_left_right(image)
    return tf.cast(image, tf.float32) / 255.0, tf.cast(example["label"], tf.int32)


def pipeline(directory, shard=None):
    """The user's input pipeline over the files in `directory`; `shard=(size, rank)` reads files[rank::size]."""
    files = tf.data.Dataset.list_files(os.path.join(directory, "*.tfrecord"), shuffle=False)
    if shard is not None:
        files = files.shard(*shard)
    return (tf.data.TFRecordDataset(files)
            .map(_preprocess, num_parallel_calls=tf.data.AUTOTUNE)
            .batch(BATCH)
            .prefetch(tf.data.AUTOTUNE))
