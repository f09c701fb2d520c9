"""Keras 3 on PyTorch: one process per replica, collectives through `torch.distributed`.

Each process runs Keras's own torch steps on its interleaved share of the inputs; the
optimizer hook (`keras_dist.optimizer_hooks`) all-reduces the gradients once per applied
update, in flat buckets, before clipping and the update rule, as DDP does after its
backward pass. Metric states are summed across processes at each epoch's end (and in
every step where a callback reads batch logs), and the chief's initial state is
broadcast to all, as on Horovod. Gloo carries the collectives on CPUs, NCCL on GPUs
(each process then drives the GPU of its local rank).

Launch: `keras-dist launch --backend torch -n 2 train.py` (the default under
`KERAS_BACKEND=torch`), `torchrun --nproc-per-node 2 train.py`, or any launcher whose
cluster environment names a coordinator (`srun`, Keras's `KERAS_DISTRIBUTION_*`).
"""

import os

import numpy as np

from keras_dist import environments
from keras_dist.strategies.base import Strategy, GradientOptions
from keras_dist.errors import KerasDistError

# Gradients travel in flat buckets of about this size: few collectives, bounded copies.
BUCKET_BYTES = 25 * 2**20


class TorchDistributedStrategy(Strategy):
    """Data parallelism on Keras's PyTorch backend with `torch.distributed`."""

    name = "torch"
    launcher = "torchrun"
    reduces_in_keras_dist = True

    @classmethod
    def detect(cls, environ) -> bool:
        return environments.detect(environ).size > 1

    def __init__(self):
        import keras

        if keras.backend.backend() != "torch":
            raise KerasDistError(f"backend 'torch' needs Keras on PyTorch, but Keras runs on "
                                 f"{keras.backend.backend()!r}; set KERAS_BACKEND=torch before Python starts")
        import torch
        import torch.distributed as dist

        self._torch, self._dist = torch, dist
        environment = environments.detect(os.environ)
        self._local_rank = environment.local_rank
        if environment.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
            # Processes sharing this machine would each size a thread pool for all of it.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // environment.local_size))
        if not dist.is_initialized() and environment.size > 1:
            if environment.coordinator is None:
                raise KerasDistError(f"the {environment.name} launcher names no coordinator for torch.distributed; "
                                     "set MASTER_ADDR and MASTER_PORT, or launch with `keras-dist launch --backend torch`")
            on_gpu = torch.cuda.is_available()
            if on_gpu:
                torch.cuda.set_device(self._local_rank % torch.cuda.device_count())
            dist.init_process_group("nccl" if on_gpu else "gloo", init_method=f"tcp://{environment.coordinator}",
                                    rank=environment.rank, world_size=environment.size)
        # NCCL collectives take tensors on the GPU; gloo's host collectives take CPU tensors.
        self._device = torch.device("cuda") if dist.is_initialized() and dist.get_backend() == "nccl" else \
            torch.device("cpu")

    @property
    def rank(self) -> int:
        return self._dist.get_rank() if self._dist.is_initialized() else 0

    @property
    def size(self) -> int:
        return self._dist.get_world_size() if self._dist.is_initialized() else 1

    @property
    def local_rank(self) -> int:
        return self._local_rank

    # --- gradients --------------------------------------------------------------
    def distribute_optimizer(self, optimizer, options: GradientOptions) -> None:
        from keras_dist import optimizer_hooks

        torch, dist = self._torch, self._dist
        if self.size == 1:
            return

        def allreduce_gradients(grads):
            present = [g for g in grads if g is not None]
            reduced = iter(self._allreduce_in_buckets(present, options))
            return [None if g is None else next(reduced) for g in grads]

        def all_finite(is_finite):
            flag = torch.as_tensor(is_finite, dtype=torch.int32, device=self._device).reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            return flag[0].to(torch.bool)

        optimizer_hooks.reduce_gradients_before_update(optimizer, allreduce_gradients, all_finite)

    def _allreduce_in_buckets(self, tensors, options):
        """Each tensor summed (or averaged) over processes, through a few flat collectives."""
        from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

        torch, dist = self._torch, self._dist
        out, bucket, size = [], [], 0
        for tensor in [*tensors, None]:  # None closes the last bucket
            fits = bucket and tensor is not None and tensor.dtype == bucket[0].dtype and \
                size + tensor.numel() * tensor.element_size() <= BUCKET_BYTES
            if tensor is not None and (not bucket or fits):
                bucket.append(tensor)
                size += tensor.numel() * tensor.element_size()
                continue
            if bucket:
                flat = _flatten_dense_tensors(bucket)  # one dtype per bucket
                wire = flat.to(torch.float16) if options.compression == "fp16" else flat
                dist.all_reduce(wire)
                flat = wire.to(flat.dtype)
                if options.reduction == "mean":
                    flat /= self.size
                out += list(_unflatten_dense_tensors(flat, bucket))
            bucket, size = ([tensor], tensor.numel() * tensor.element_size()) if tensor is not None else ([], 0)
        return out

    def sum_across_processes_in_step(self, tensors):
        tensors = [self._torch.as_tensor(t) for t in tensors]
        return self._allreduce_in_buckets(tensors, GradientOptions(reduction="sum")) if self.size > 1 else tensors

    # --- host-side collectives ----------------------------------------------------
    def allgather_object(self, obj) -> list:
        if self.size == 1:
            return [obj]
        gathered = [None] * self.size
        self._dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj, root: int = 0):
        if self.size == 1:
            return obj
        box = [obj]
        self._dist.broadcast_object_list(box, src=root)
        return box[0]

    def broadcast_variables(self, variables, root: int = 0) -> None:
        if self.size == 1:
            return
        for variable in variables:
            value = variable.value
            wire = value.detach().to(self._device)
            self._dist.broadcast(wire, src=root)
            with self._torch.no_grad():
                value.copy_(wire.to(value.device))

    def sum_arrays(self, arrays):
        arrays = [np.asarray(a) for a in arrays]
        if not arrays or self.size == 1:
            return arrays
        torch = self._torch
        summed = self._allreduce_in_buckets([torch.from_numpy(np.array(a, np.float64)).to(self._device)
                                             for a in arrays], GradientOptions(reduction="sum"))
        return [s.cpu().numpy().reshape(a.shape).astype(a.dtype) for s, a in zip(summed, arrays)]

    def barrier(self) -> None:
        if self.size > 1:
            self._dist.barrier()
