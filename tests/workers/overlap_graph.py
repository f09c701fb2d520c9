"""Traces one keras_dist Horovod train step and prints, as JSON, its gradient collectives:
for each, the bytes it carries and whether it waits for another collective.

A single process (Horovod of size 1) traces the same graph as each rank of a job.
"""

import json
import os

import keras
import tensorflow as tf

import keras_dist

keras_dist.init(backend="horovod")
model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(64),
                          keras.layers.Dense(1)])
keras_dist.compile(model, optimizer="sgd", loss="mse")
x, y = tf.zeros((4, 8)), tf.zeros((4, 1))


@tf.function
def step():
    return model.train_step((x, y))


graph = step.get_concrete_function().graph
collectives = [op for op in graph.get_operations() if op.type.startswith("HorovodGroupedAllreduce")]


def ancestors(op, seen):
    for tensor in op.inputs:
        if tensor.op not in seen:
            seen.add(tensor.op)
            ancestors(tensor.op, seen)
    for control in op.control_inputs:
        if control not in seen:
            seen.add(control)
            ancestors(control, seen)
    return seen


print("COLLECTIVES", json.dumps([
    {"bytes": sum(t.shape.num_elements() * t.dtype.size for t in op.inputs),
     "waits_for_another": any(a in collectives for a in ancestors(op, set()))}
    for op in collectives]), "LIMIT", os.environ.get("KERAS_DIST_BUCKET_BYTES"))
