"""Mixed precision: by the sharding policy under data parallel, by autocast only on one process.

Under FSDP / HSDP / replicate the parameters are all-gathered (or cast) to `param_dtype` by the
policy, gradients are reduced in `reduce_dtype`, and the sharded fp32 parameters are what the
optimizer steps: autocast on top would cast a second time and is never used. A plain
single-process run has no policy to do that, so there autocast stands in for it.
"""

import contextlib

import torch
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

from plait.mesh import Meshes

from .config import DataParallelConfig


def mixed_precision_policy(config: DataParallelConfig) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=config.param_dtype, reduce_dtype=config.reduce_dtype)


def offload_policy(config: DataParallelConfig, device_type: str) -> OffloadPolicy:
    if config.cpu_offload:
        # Pinned host memory only helps (and only exists) with an accelerator to copy to.
        return CPUOffloadPolicy(pin_memory=device_type != "cpu")
    return OffloadPolicy()


def autocast_context(meshes: Meshes | None, config: DataParallelConfig, device_type: str):
    """A context manager for the forward (and loss): autocast to `param_dtype` on a plain
    single-process run, a no-op wherever data parallel (or any parallelism) owns the parameters.

        with autocast_context(meshes, config, device_type):
            loss = loss_fn(model(tokens), labels)
    """
    single_process = meshes is None or meshes.dims.world_size == 1
    dtype = config.param_dtype
    if single_process and dtype is not None and dtype != torch.float32:
        return torch.autocast(device_type, dtype=dtype)
    return contextlib.nullcontext()
