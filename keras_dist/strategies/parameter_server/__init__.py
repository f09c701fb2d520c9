"""Parameter-server training: `tf.distribute.ParameterServerStrategy` driven by `ClusterCoordinator`.

Keras 3 has no parameter-server support (keras-team/keras#18624), so this backend runs
`fit`, `evaluate` and `predict` itself, on the chief, with Keras's own `train_step`,
`test_step` and `predict_step` executed on the workers as scheduled closures. Worker and
ps tasks only serve: `import keras_dist` turns them into TensorFlow servers and never
returns, so one unchanged script runs on every task.

Training is asynchronous: each closure reads the variables on the ps tasks, computes
one batch's update and applies it, while other workers do the same.

The package's parts: `server` (what worker and ps tasks run), `strategy` (the chief's
strategy), `loop` (fit/evaluate/predict as scheduled closures), `step_watch` (the step
timeout, on a thread of its own) and `sharded_variables` (variables a partitioner split
over the ps tasks).
"""
