"""`apply_data_parallel`: the one entry point; the degrees choose FSDP, HSDP, replicate or DDP."""

import logging
from collections.abc import Sequence

import torch
from torch import nn

from plait.mesh import Meshes, ParallelConfigError

from .config import DataParallelConfig, validate
from .fsdp import apply_fsdp
from .replicate import apply_ddp, apply_replicate

logger = logging.getLogger(__name__)


def apply_data_parallel(
    model: nn.Module,
    meshes: Meshes,
    blocks: Sequence[str],
    config: DataParallelConfig,
    expert_modules: Sequence[str] = (),
    edge_units: Sequence[Sequence[str]] = (),
) -> nn.Module:
    """Shard or replicate `model` over the data-parallel meshes, as `meshes.dims` says.

    - dp_shard * cp > 1, dp_replicate == 1: FSDP over meshes.fsdp (= dp_shard_cp)
    - dp_shard * cp > 1, dp_replicate > 1: HSDP over the 2D (replicate, shard) meshes.fsdp
    - dp_shard * cp == 1, dp_replicate > 1: replicate over meshes.dp_replicate ("fsdp") or DDP ("ddp")
    - otherwise: returned unchanged

    `blocks` are the repeated units (model.parallel_info()["blocks"]), each sharded on its own
    then the root; `expert_modules` (routed experts) are sharded over meshes.expert_fsdp.
    `edge_units` (model.parallel_info()["edge_units"], FSDP / HSDP only) are groups of module
    paths outside the blocks in forward order, e.g. [["tok_embeddings"], ["norm", "output"]]: each
    group is its own unit, so the embedding is resharded once used and the output head is
    gathered only around its use instead of the root holding both for the whole step. Call
    after tensor / expert parallel, activation checkpointing and compile, with the model still
    on the meta device or materialised (DDP needs it materialised). Returns the model, wrapped
    only for DDP. Every check runs before any collective and raises ParallelConfigError.
    """
    if isinstance(blocks, str) or isinstance(expert_modules, str):
        raise ParallelConfigError("blocks and expert_modules are lists of module paths, not a single string.")
    blocks, expert_modules = list(blocks), list(expert_modules)
    edge_units = [[unit] if isinstance(unit, str) else list(unit) for unit in edge_units]
    mode = validate(model, meshes, blocks, config, expert_modules, edge_units)
    if mode == "none":
        if meshes.dims.world_size > 1 and config.param_dtype not in (None, torch.float32):
            logger.warning(
                "data_parallel.param_dtype = %s: no data-parallel degree > 1, so no sharding policy casts the "
                "parameters, and autocast_context is a no-op on multi-rank runs; the caller decides how to run "
                "in low precision (or the run is fp32).",
                config.param_dtype,
            )
        return model
    if mode in ("fsdp", "hsdp"):
        return apply_fsdp(model, meshes, blocks, config, expert_modules, edge_units)
    if mode == "replicate":
        return apply_replicate(model, meshes, blocks, config)
    return apply_ddp(model, meshes)
