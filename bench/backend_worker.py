"""One measured run of bench/run.py on Keras's JAX or PyTorch backend (KERAS_BACKEND).

    KERAS_BACKEND=jax|torch python backend_worker.py MODE MODEL --window S --windows K [--sync DIR]

MODE:
  plain        Keras `fit` in one process
  keras_dist   the two-line change, on the backend the launcher implies (jax or torch)
  keras_native Keras's own data parallelism, without keras_dist, each process fitting its
               interleaved share: on JAX `keras.distribution.initialize()` and `DataParallel`;
               on PyTorch (Keras >= 3.16) a gloo process group, which makes Keras wrap the
               model in DistributedDataParallel (keras-team/keras#23316)
  handwritten  that framework's own data-parallel loop, without Keras's trainer: for JAX
               a jitted step whose batch is sharded over every process's devices (XLA
               all-reduces the gradients); for PyTorch a `torch.nn` model under DistributedDataParallel,
               or under horovodrun Horovod's DistributedOptimizer

MODEL: the bench's MLP (784-1024-1024-10, batch 128 per replica, 60 batches per process
and epoch) or its CNN (bench/models.py; batch 64, 20 batches). For the CNN `handwritten`
trains the same Keras network: DDP wraps it (a `torch.nn.Module` on that backend), and
the JAX step calls its `stateless_call`. SGD, NumPy input, unshuffled.

`BENCH_THREADS` sets the intra-op threads of each process, `BENCH_COMPRESSION` keras_dist's
`gradient_compression`. Measuring is bench/windows.py's; every process prints one
`BENCH {json}` line.
"""

import argparse
import os
import sys

parser = argparse.ArgumentParser()
parser.add_argument("mode", choices=["plain", "keras_dist", "keras_native", "handwritten"])
parser.add_argument("model", choices=["mlp", "cnn"])
parser.add_argument("--window", type=float, required=True)
parser.add_argument("--windows", type=int, required=True)
parser.add_argument("--sync")
parser.add_argument("--data", help="unused (bench/run.py passes it to every worker)")
args = parser.parse_args()

BACKEND = os.environ["KERAS_BACKEND"]
THREADS = int(os.environ.get("BENCH_THREADS", "1"))
if BACKEND == "jax":  # before JAX starts
    os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=false "
                               f"intra_op_parallelism_threads={THREADS}").strip()

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import CNN_BATCH, CNN_INPUT, CNN_STEPS, cnn_layers  # noqa: E402
from windows import Windows  # noqa: E402

if args.mode == "keras_dist":
    import keras_dist
if BACKEND == "torch":
    import torch

    torch.set_num_threads(THREADS)

UNITS = (784, 1024, 1024, 10)
CNN = args.model == "cnn"
BATCH, STEPS, SHAPE = (CNN_BATCH, CNN_STEPS, CNN_INPUT) if CNN else (128, 60, UNITS[:1])


def arrays(count):
    rng = np.random.default_rng(0)
    return rng.random((count, *SHAPE), dtype=np.float32), rng.integers(0, UNITS[-1], count).astype("int32")


def keras_model():
    import keras

    hidden = cnn_layers() if CNN else [keras.layers.Dense(UNITS[1], activation="relu"),
                                       keras.layers.Dense(UNITS[2], activation="relu"), keras.layers.Dense(UNITS[3])]
    return keras.Sequential([keras.Input(SHAPE), *hidden])


def keras_run(rank, size, windows, compile_model, own_share=False):
    """`fit` until `windows` close; `own_share`: this process fits rows rank::size itself
    (Keras's native data parallelism), else all rows (keras_dist shards them)."""
    import keras

    class Measure(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if windows.epoch_end(STEPS * BATCH):
                self.model.stop_training = True

    keras.utils.set_random_seed(0)
    model = keras_model()
    # BENCH_OPTIMIZER=adam: an optimizer with state (bench/run.py's keras_dist_adam_2, keras_dist_shard_2).
    optimizer = keras.optimizers.Adam(0.001) if os.environ.get("BENCH_OPTIMIZER") == "adam" else keras.optimizers.SGD(0.01)
    compile_model(model, optimizer=optimizer,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = arrays(STEPS * BATCH * size)
    if own_share:
        x, y = x[rank::size], y[rank::size]
    model.fit(x, y, batch_size=BATCH, epochs=100000, shuffle=False, verbose=0, callbacks=[Measure()])
    return model.count_params()


def keras_native(windows_for):
    import keras

    if BACKEND == "jax":
        import jax

        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        keras.distribution.initialize()  # the KERAS_DISTRIBUTION_* variables keras_dist's launcher sets
        keras.distribution.set_distribution(keras.distribution.DataParallel(auto_shard_dataset=False))
        rank, size = jax.process_index(), jax.process_count()
    else:
        if tuple(int(p) for p in keras.__version__.split(".")[:2]) < (3, 16):
            raise SystemExit(f"Keras {keras.__version__} has no data parallelism of its own on PyTorch (3.16 has)")
        import torch.distributed as dist

        dist.init_process_group("gloo")  # torchrun's variables: Keras then wraps the model in DDP
        rank, size = dist.get_rank(), dist.get_world_size()
    windows = windows_for(rank)
    params = keras_run(rank, size, windows, lambda model, **kw: model.compile(**kw), own_share=True)
    return windows, rank, size, params


def jax_handwritten(windows_for):
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    # The variables keras_dist's launcher sets (importing keras_dist would join the group itself).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"],
                               int(os.environ["KERAS_DISTRIBUTION_NUM_PROCESSES"]),
                               int(os.environ["KERAS_DISTRIBUTION_PROCESS_ID"]))
    mesh = Mesh(np.array(jax.devices()), ("batch",))
    replicated, by_batch = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("batch"))
    if CNN:  # the Keras network as a pure function of its weights (it has no other state)
        import keras

        keras.utils.set_random_seed(0)
        network = keras_model()
        params = [v.value for v in network.trainable_variables]

        def logits_of(params, x):
            return network.stateless_call(params, [], x, training=True)[0]
    else:
        key = jax.random.PRNGKey(0)
        params = []
        for fan_in, fan_out in zip(UNITS[:-1], UNITS[1:]):
            key, sub = jax.random.split(key)
            limit = np.sqrt(6 / (fan_in + fan_out))
            params.append((jax.random.uniform(sub, (fan_in, fan_out), minval=-limit, maxval=limit), jnp.zeros(fan_out)))

        def logits_of(params, x):
            for i, (w, b) in enumerate(params):
                x = x @ w + b
                if i < len(params) - 1:
                    x = jax.nn.relu(x)
            return x
    params = jax.device_put(params, replicated)

    def loss_fn(params, x, y):
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits_of(params, x)), y[:, None], axis=1))

    @jax.jit
    def step(params, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
        return jax.tree.map(lambda p, g: p - 0.01 * g, params, grads), loss

    rank, size = jax.process_index(), jax.process_count()
    x, y = arrays(STEPS * BATCH * size)
    x, y = x[rank::size], y[rank::size]
    windows, done = windows_for(rank), False
    while not done:
        for i in range(STEPS):
            xb = jax.make_array_from_process_local_data(by_batch, x[i * BATCH:(i + 1) * BATCH])
            yb = jax.make_array_from_process_local_data(by_batch, y[i * BATCH:(i + 1) * BATCH])
            params, loss = step(params, xb, yb)
        loss.block_until_ready()
        done = windows.epoch_end(STEPS * BATCH)
    return windows, rank, size, sum(leaf.size for leaf in jax.tree.leaves(params))


def torch_handwritten(windows_for):
    """DDP over gloo under keras_dist's torchrun launcher; under horovodrun, Horovod's own
    `DistributedOptimizer` (the reference for keras_dist's torch backend on Horovod)."""
    on_horovod = "HOROVOD_RANK" in os.environ
    if on_horovod:
        import horovod.torch as hvd

        hvd.init()
        rank, size = hvd.rank(), hvd.size()
    else:
        import torch.distributed as dist

        dist.init_process_group("gloo")  # torchrun's variables, set by keras_dist's launcher
        rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    if CNN:
        model = keras_model()  # on Keras's torch backend a torch.nn.Module with its variables as parameters
    else:
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(UNITS[:-1], UNITS[1:])):
            layers += [torch.nn.Linear(fan_in, fan_out)] + ([torch.nn.ReLU()] if i < len(UNITS) - 2 else [])
        model = torch.nn.Sequential(*layers)
    if on_horovod:
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                             named_parameters=model.named_parameters())
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loss_fn = torch.nn.CrossEntropyLoss()
    x, y = arrays(STEPS * BATCH * size)
    x, y = torch.from_numpy(x[rank::size]), torch.from_numpy(y[rank::size]).long()
    windows, done = windows_for(rank), False
    while not done:
        for i in range(STEPS):
            optimizer.zero_grad()
            loss = loss_fn(model(x[i * BATCH:(i + 1) * BATCH]), y[i * BATCH:(i + 1) * BATCH])
            loss.backward()
            optimizer.step()
        done = windows.epoch_end(STEPS * BATCH)
    return windows, rank, size, sum(p.numel() for p in model.parameters())


def main():
    def windows_for(rank):
        return Windows(rank, args.sync, args.window, args.windows)

    if args.mode == "handwritten":
        windows, rank, size, params = (jax_handwritten if BACKEND == "jax" else torch_handwritten)(windows_for)
    elif args.mode == "keras_native":
        windows, rank, size, params = keras_native(windows_for)
    elif args.mode == "plain":
        rank, size, windows = 0, 1, windows_for(0)
        params = keras_run(0, 1, windows, lambda model, **kw: model.compile(**kw))
    else:
        ctx = keras_dist.init()
        rank, size, windows = ctx.rank, ctx.size, windows_for(ctx.rank)
        params = keras_run(rank, size, windows, lambda model, **kw: keras_dist.compile(
            model, gradient_compression=os.environ.get("BENCH_COMPRESSION") or None,
            shard=os.environ.get("BENCH_SHARD") or None, **kw))
    windows.report(size, params)


main()
