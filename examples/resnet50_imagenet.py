"""ResNet-50 on ImageNet, data-parallel over the GPUs of a cluster with keras_dist.

One process per GPU, started by Horovod (here 2 machines with 8 GPUs each):

    horovodrun -np 16 -H node1:8,node2:8 python examples/resnet50_imagenet.py \\
        --data-dir /data/tensorflow_datasets --output-dir /shared/resnet50

On one machine, `keras-dist launch --backend horovod -n 8 examples/resnet50_imagenet.py ...`
starts the same processes. With `TF_CONFIG` set on each machine instead, one process per
machine trains on all of that machine's GPUs (keras_dist's multi_worker_mirrored backend).

--data-dir is a TFDS data directory holding a prepared `imagenet2012` (nothing is
downloaded). Without it the script trains on small synthetic images made on the spot
(examples/synthetic_data.py), which checks a set-up without any data.

--batch-size is per replica (per GPU): 16 GPUs at 128 make a global batch of 2048. The
learning rate follows: 0.1 per 256 images of the global batch, reached by a linear warmup.

The chief alone writes --output-dir: the best model by validation accuracy (best.keras),
TensorBoard logs (tensorboard/) and the state to resume from (backup/). Rerunning the same
command after a crash or preemption resumes every process from the last finished epoch;
keep --output-dir on storage the chief's machine reaches again (shared storage if the
chief may move). --exit-after-epochs is a testing aid that simulates such a preemption.
"""

import argparse
import os
import signal
import sys

import keras
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

import keras_dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import synthetic_data  # noqa: E402

# Per process: encoded JPEGs (about 110 kB each in ImageNet), so about 1 GB of host memory.
SHUFFLE_BUFFER = 10_000
# Goyal et al., "Accurate, Large Minibatch SGD": 0.1 per 256 images, linear in the batch.
LEARNING_RATE_PER_256_IMAGES = 0.1
# The classic recipe divides the rate by 10 at epochs 30, 60 and 80 of 90.
DECAY_AT_FRACTIONS_OF_TRAINING = (30 / 90, 60 / 90, 80 / 90)


def parse_args():
    parser = argparse.ArgumentParser(description="ResNet-50 on ImageNet with keras_dist.")
    parser.add_argument("--data-dir", help="TFDS data directory holding a prepared imagenet2012 (default: synthetic)")
    parser.add_argument("--image-size", type=int, default=224, help="side of the square training images (32 or more)")
    parser.add_argument("--batch-size", type=int, default=128, help="per replica (per GPU)")
    parser.add_argument("--epochs", type=int, default=90)
    parser.add_argument("--warmup-epochs", type=float, default=5)
    parser.add_argument("--steps-per-epoch", type=int, help="default: one pass over the training set")
    parser.add_argument("--validation-steps", type=int, help="default: the whole validation set")
    parser.add_argument("--output-dir", default="/tmp/resnet50_imagenet")
    parser.add_argument("--precision", choices=["auto", "float32", "mixed_float16", "mixed_bfloat16"], default="auto",
                        help="auto: mixed_float16 on GPUs, float32 on CPUs")
    parser.add_argument("--exit-after-epochs", type=int,
                        help="testing aid: the chief kills itself after this many epochs, as a preempted job dies")
    return parser.parse_args()


def choose_precision(requested):
    if requested != "auto":
        return requested
    if tf.config.list_physical_devices("GPU"):
        return "mixed_float16"  # Tensor cores; Keras adds loss scaling (LossScaleOptimizer).
    # CPUs: float16 convolutions fall back to slow generic kernels (about 10x slower than
    # float32 on an AVX-512 development machine), and bfloat16 ran at float32's speed there;
    # it pays on CPUs with AMX, where --precision mixed_bfloat16 asks for it.
    return "float32"


def imagenet_splits(data_dir, num_processes, process_index):
    """This process's part of ImageNet's train and validation splits, as (JPEG, label) pairs."""
    # Each process reads only its 1/N of the examples: letting keras_dist split the full
    # input would make every process read and decode all of ImageNet to keep 1/N of it.
    splits = [tfds.even_splits(name, n=num_processes)[process_index] for name in ("train", "validation")]
    (train, validation), info = tfds.load(
        "imagenet2012", split=splits, data_dir=data_dir, download=False, as_supervised=True, with_info=True,
        shuffle_files=True, decoders={"image": tfds.decode.SkipDecoding()},  # decoded after cropping, below
    )
    return train, validation, info.features["label"].num_classes, info.splits["train"].num_examples


def synthetic_splits(num_processes, process_index):
    """synthetic_data's images as RGB JPEGs, so they take the same path as ImageNet's."""
    (x_train, y_train), (x_validation, y_validation) = synthetic_data.load_data()

    def as_jpegs(images, labels):
        rgb = np.repeat(np.uint8(np.clip(images, 0.0, 1.0) * 255), 3, axis=-1)
        dataset = tf.data.Dataset.from_tensor_slices((rgb, labels)).shard(num_processes, process_index)
        return dataset.map(lambda image, label: (tf.io.encode_jpeg(image), label))

    return as_jpegs(x_train, y_train), as_jpegs(x_validation, y_validation), synthetic_data.NUM_CLASSES, len(x_train)


def random_crop_and_flip(jpeg, image_size):
    """Training augmentation: a random window of 8-100% of the image, aspect 3:4 to 4:3."""
    begin, size, _ = tf.image.sample_distorted_bounding_box(
        tf.image.extract_jpeg_shape(jpeg), bounding_boxes=tf.zeros([1, 0, 4]), min_object_covered=0.08,
        area_range=(0.08, 1.0), aspect_ratio_range=(3 / 4, 4 / 3), max_attempts=10,
        use_image_if_no_bounding_boxes=True,
    )
    # Decoding only the window is cheaper than decoding the whole image and cropping it.
    image = tf.image.decode_and_crop_jpeg(jpeg, tf.stack([begin[0], begin[1], size[0], size[1]]), channels=3)
    image = tf.image.resize(image, (image_size, image_size))
    return tf.image.random_flip_left_right(image)


def resize_and_center_crop(jpeg, image_size):
    """Validation: the shorter side resized to image_size / 0.875, then the central square."""
    image = tf.io.decode_jpeg(jpeg, channels=3)
    height_width = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = image_size / 0.875 / tf.reduce_min(height_width)
    image = tf.image.resize(image, tf.cast(tf.round(height_width * scale), tf.int32))
    return tf.image.resize_with_crop_or_pad(image, image_size, image_size)


def input_pipeline(examples, preprocess, batch_size, training):
    if training:
        examples = examples.shuffle(SHUFFLE_BUFFER).repeat()  # epochs are --steps-per-epoch long
    images = examples.map(
        lambda jpeg, label: (keras.applications.resnet50.preprocess_input(preprocess(jpeg)), label),
        num_parallel_calls=tf.data.AUTOTUNE,
    )
    # Equal, full batches on every process in training: each step is a collective.
    batches = images.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    # Split by process already (above): tells keras_dist and tf.distribute not to split it again.
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return batches.with_options(options)


class ExitAfterEpochs(keras.callbacks.Callback):
    """Kills this process at the end of an epoch, after the callbacks before it have saved."""

    def __init__(self, epochs):
        super().__init__()
        self.epochs = epochs

    def on_epoch_end(self, epoch, logs=None):
        if epoch + 1 == self.epochs:
            os.kill(os.getpid(), signal.SIGKILL)


def main():
    args = parse_args()
    cluster = keras_dist.init()
    precision = choose_precision(args.precision)
    keras.mixed_precision.set_global_policy(precision)

    if args.data_dir:
        train, validation, num_classes, num_train_examples = imagenet_splits(args.data_dir, cluster.size, cluster.rank)
    else:
        train, validation, num_classes, num_train_examples = synthetic_splits(cluster.size, cluster.rank)
    # Batched per replica: keras_dist feeds a process that drives several GPUs that many batches.
    train = input_pipeline(train, lambda jpeg: random_crop_and_flip(jpeg, args.image_size), args.batch_size, True)
    validation = input_pipeline(
        validation, lambda jpeg: resize_and_center_crop(jpeg, args.image_size), args.batch_size, False)
    steps_per_epoch = args.steps_per_epoch or num_train_examples // (args.batch_size * cluster.num_replicas)

    backbone = keras.applications.ResNet50(
        weights=None, include_top=False, pooling="avg", input_shape=(args.image_size, args.image_size, 3))
    # The classifier stays in float32 under mixed precision: top-5 accuracy
    # (tf.math.in_top_k) accepts float32 logits only.
    logits = keras.layers.Dense(num_classes, dtype="float32", name="predictions")(backbone.output)
    model = keras.Model(backbone.input, logits, name="resnet50")
    print(f"precision policy: {precision}, compute dtype: {model.compute_dtype}, "
          f"variable dtype: {model.variable_dtype}")
    # Keras applies weight decay outside the momentum: 1e-3 shrinks weights as fast as the
    # classic L2 penalty of 1e-4 does through momentum 0.9. Batch norm and biases are exempt.
    optimizer = keras.optimizers.SGD(
        LEARNING_RATE_PER_256_IMAGES * args.batch_size / 256, momentum=0.9, weight_decay=1e-3)
    optimizer.exclude_from_weight_decay(var_names=["gamma", "beta", "bias"])
    keras_dist.compile(
        model, optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(5, name="top5_accuracy")],
        scale_learning_rate=True,  # times the number of replicas: 0.1 per 256 images of the global batch
    )

    peak_learning_rate = float(model.optimizer.learning_rate)
    decay_epochs = [round(args.epochs * fraction) for fraction in DECAY_AT_FRACTIONS_OF_TRAINING]
    callbacks = [
        # A function of the epoch alone, so a resumed run picks the schedule up where it was.
        keras.callbacks.LearningRateScheduler(
            lambda epoch, _: peak_learning_rate * 0.1 ** sum(epoch >= decay for decay in decay_epochs)),
        # Ramps from the unscaled to the scaled rate. It reads that target when training
        # starts, so it must come before BackupAndRestore, which restores the rate on the
        # chief only: the other processes would ramp to another rate.
        keras_dist.callbacks.LearningRateWarmup(args.warmup_epochs),
        # Keeps the previous state too: a job killed while saving still resumes.
        keras.callbacks.BackupAndRestore(os.path.join(args.output_dir, "backup"), double_checkpoint=True),
        keras.callbacks.ModelCheckpoint(
            os.path.join(args.output_dir, "best.keras"), monitor="val_accuracy", save_best_only=True),
        keras.callbacks.TensorBoard(os.path.join(args.output_dir, "tensorboard")),
    ]
    if args.exit_after_epochs and cluster.is_chief:
        # The chief dies once its files are written; the launcher then stops the others.
        callbacks.append(ExitAfterEpochs(args.exit_after_epochs))
    history = model.fit(train, validation_data=validation, epochs=args.epochs, steps_per_epoch=steps_per_epoch,
                        validation_steps=args.validation_steps, callbacks=callbacks, verbose=2)
    print(f"epochs run: {' '.join(str(epoch + 1) for epoch in history.epoch)}  "
          f"final loss: {history.history['loss'][-1]:.6f}")


if __name__ == "__main__":
    main()
