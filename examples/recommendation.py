"""Recommendation model with large embedding tables, for the parameter-server backend.

Predicts whether a user likes an item from two embedding tables (users and items), the
kind of model parameter servers are picked for. Under the parameter_server backend the
tables live on the ps tasks and workers train asynchronously; the script itself is an
ordinary single-device Keras script plus keras_dist's two lines.

    python examples/recommendation.py                      # one process
    keras-dist launch --backend parameter_server -n 2 --ps 2 examples/recommendation.py
    # The same, with each table of 64 KiB or more split over both ps tasks:
    KERAS_DIST_MIN_SHARD_BYTES=65536 keras-dist launch --backend parameter_server -n 2 --ps 2 \
        examples/recommendation.py

Interactions are synthetic (made on the spot, no download): hidden user and item
factors decide the labels, so a model that learns the tables reaches high accuracy.
Environment: USERS, ITEMS, INTERACTIONS, EPOCHS, BATCH_SIZE (per worker), OUTPUT.
"""

import os

import numpy as np
import keras
import keras_dist

USERS = int(os.environ.get("USERS", 5000))
ITEMS = int(os.environ.get("ITEMS", 500))
INTERACTIONS = int(os.environ.get("INTERACTIONS", 100000))
EPOCHS = int(os.environ.get("EPOCHS", 4))
BATCH_SIZE = int(os.environ.get("BATCH_SIZE", 128))
OUTPUT = os.environ.get("OUTPUT", "recommendation_output")


def interactions(count, seed):
    """`(user, item)` pairs and 0/1 labels from hidden 4-dimensional tastes."""
    rng = np.random.default_rng(0)  # the same hidden tastes for every split
    user_taste, item_taste = rng.normal(size=(USERS, 4)), rng.normal(size=(ITEMS, 4))
    rng = np.random.default_rng(seed)
    users, items = rng.integers(0, USERS, count), rng.integers(0, ITEMS, count)
    labels = (np.sum(user_taste[users] * item_taste[items], axis=1, keepdims=True) > 0).astype("float32")
    return {"user": users.astype("int32"), "item": items.astype("int32")}, labels


def build_model(dim=16):
    user, item = keras.Input((), name="user", dtype="int32"), keras.Input((), name="item", dtype="int32")
    user_vector = keras.layers.Embedding(USERS, dim, name="user_embedding")(user)
    item_vector = keras.layers.Embedding(ITEMS, dim, name="item_embedding")(item)
    affinity = keras.layers.Dot(axes=1)([user_vector, item_vector])
    return keras.Model({"user": user, "item": item}, keras.layers.Dense(1, activation="sigmoid")(affinity))


keras.utils.set_random_seed(0)
(x, y), (x_test, y_test) = interactions(INTERACTIONS, 1), interactions(INTERACTIONS // 5, 2)
model = build_model()
keras_dist.compile(model, optimizer=keras.optimizers.Adam(0.01), loss="binary_crossentropy", metrics=["accuracy"])
os.makedirs(OUTPUT, exist_ok=True)
model.fit(x, y, batch_size=BATCH_SIZE, epochs=EPOCHS, validation_data=(x_test, y_test), verbose=2,
          callbacks=[keras.callbacks.BackupAndRestore(os.path.join(OUTPUT, "backup")),
                     keras.callbacks.CSVLogger(os.path.join(OUTPUT, "log.csv"))])
loss, accuracy = model.evaluate(x_test, y_test, batch_size=1024, verbose=0)
print(f"test accuracy: {accuracy:.4f}")
table = model.get_layer("user_embedding").embeddings.value
print(f"user table on {', '.join(part.device for part in getattr(table, 'variables', [table]))}")
