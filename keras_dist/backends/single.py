"""The plain single-process backend: what a script gets without any launcher."""

from keras_dist.backends.base import Backend


class SingleBackend(Backend):
    """One process, one replica; keras_dist changes nothing about training."""

    name = "single"
