"""An MLP trained with Adam in a process whose memory is capped: the script of a model that does not fit.

    python memory_cap.py CAP_MIB [--shard optimizer|weights] [--width W] [--cap-rank R]

Caps this process's data memory at CAP_MIB MiB (`RLIMIT_DATA`: its heap and private
writable mappings, where NumPy's, PyTorch's and XLA's CPU buffers live; unlike a cgroup's
limit, an allocation past it fails in the allocator, an error keras_dist can name, where
the kernel's OOM killer would end the process with no output). `RLIMIT_AS` would count
the address space the frameworks reserve and never use. Then trains 4 Dense layers of W
units (4096: 67M weights, 256 MiB; Adam's state 512 MiB) for 4 steps of 16 samples a
process, and prints "trained".
"""

import argparse
import os
import resource

parser = argparse.ArgumentParser()
parser.add_argument("cap_mib", type=int)
parser.add_argument("--shard", choices=["optimizer", "weights"])
parser.add_argument("--width", type=int, default=4096)
parser.add_argument("--cap-rank", type=int, help="cap this local rank alone (one machine running short)")
args = parser.parse_args()
# Set before the frameworks load: what they allocate at import counts, as on a device.
if args.cap_rank is None or int(os.environ["LOCAL_RANK"]) == args.cap_rank:
    resource.setrlimit(resource.RLIMIT_DATA, (args.cap_mib * 2**20, args.cap_mib * 2**20))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_dist  # noqa: E402

context = keras_dist.init()
keras.utils.set_random_seed(0)
model = keras.Sequential([keras.Input((args.width,)),
                          *[keras.layers.Dense(args.width, activation="relu") for _ in range(4)], keras.layers.Dense(10)])
keras_dist.compile(model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                   **({"shard": args.shard} if args.shard else {}))
x = np.random.default_rng(0).normal(size=(4 * 16 * context.size, args.width)).astype("float32")
model.fit(x, np.zeros(len(x), "int32"), batch_size=16, epochs=1, shuffle=False, verbose=0)
print("trained", model.count_params(), flush=True)
