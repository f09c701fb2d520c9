"""Callbacks keras_dist adds or offers; user callbacks need no change."""

from keras_dist.callbacks.file_callbacks import callbacks_for_this_worker, chief_only
from keras_dist.callbacks.learning_rate_warmup import LearningRateWarmup
from keras_dist.callbacks.sync_state import SyncInitialState

__all__ = ["LearningRateWarmup", "SyncInitialState", "callbacks_for_this_worker", "chief_only"]
