"""The plain single-process backend: what a script gets without any launcher."""

from keras_dist.strategies.base import Strategy


class SingleProcessStrategy(Strategy):
    """One process, one replica; keras_dist changes nothing about training."""

    name = "single"
