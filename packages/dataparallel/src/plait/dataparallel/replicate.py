"""Pure replication (dp_replicate > 1, dp_shard * cp == 1): torch's FSDP-based `replicate`, or DDP.

`replicate` (torch.distributed._composable.replicate_with_fsdp) is FSDP2 with nothing sharded: it
takes the 1D replicate mesh, leaves parameters as DTensors Replicate() on that mesh (so state dicts
and the optimizer see the same parameter names and shapes as the unwrapped model), all-reduces
gradients per unit, and takes the same MixedPrecisionPolicy as fully_shard. Applied per block then
the root, so each block's gradients are all-reduced as soon as its backward is done.

Classic DistributedDataParallel stays available (`replicate_impl = "ddp"`) for plain fp32 models;
it wraps the model (state dict keys gain a "module." prefix).
"""

from collections.abc import Sequence

from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.nn.parallel import DistributedDataParallel

from plait.mesh import Meshes, collectives_on_gloo

from .config import DataParallelConfig
from .precision import mixed_precision_policy, offload_policy


def apply_replicate(
    model: nn.Module,
    meshes: Meshes,
    blocks: Sequence[str],
    config: DataParallelConfig,
) -> nn.Module:
    mesh = meshes.dp_replicate  # 1D in, parameters on this 1D mesh out
    modules = dict(model.named_modules())
    kwargs = dict(
        mesh=mesh,
        mp_policy=mixed_precision_policy(config),
        offload_policy=offload_policy(config, mesh.device_type),
    )
    units = [replicate(modules[path], **kwargs) for path in blocks]
    root = replicate(model, **kwargs)
    if collectives_on_gloo(mesh) and mesh.device_type != "cpu":
        # CUDA ranks sharing a GPU: all-reduce with SUM and let FSDP divide (gloo's AVG on CUDA
        # tensors differs between torch versions; see fsdp.reduce_on_gloo).
        for unit in [*units, root]:
            unit.set_force_sum_reduction_for_comms(True)
    if config.prefetch:
        # replicate has nothing to all-gather unless parameters are cast or offloaded; the hooks are
        # the same as FSDP's, so the same explicit ordering applies.
        for i, unit in enumerate(units):
            if i + 1 < len(units):
                unit.set_modules_to_forward_prefetch([units[i + 1]])
            if i > 0:
                unit.set_modules_to_backward_prefetch([units[i - 1]])
    return model


def apply_ddp(model: nn.Module, meshes: Meshes) -> nn.Module:
    device = next((p.device for p in model.parameters()), None)
    device_ids = [device] if device is not None and device.type == "cuda" else None
    return DistributedDataParallel(
        model,
        process_group=meshes.dp_replicate.get_group(),
        device_ids=device_ids,
        # Buffers (RoPE tables) are computed the same on every rank: synced once at wrap time, not per step.
        forward_sync_buffers=False,
    )
