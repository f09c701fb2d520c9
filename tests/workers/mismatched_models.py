"""Rank 1 builds a wider model than rank 0: keras_dist must refuse before training."""

import numpy as np
import keras

import keras_dist

ctx = keras_dist.init()
model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8 + ctx.rank), keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
model.fit(np.zeros((32, 4), "float32"), np.zeros((32, 1), "float32"), batch_size=8, verbose=0)
