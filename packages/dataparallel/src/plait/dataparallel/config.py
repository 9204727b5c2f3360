"""What the user states about data parallel, and the checks made before any collective.

The user states degrees (in `plait.mesh.ParallelDims`), not a mode; `data_parallel_mode` derives
the mode from them. Every check here reads only the degrees, the config and the module tree, so a
bad setting fails on every rank at once with a message naming it, instead of hanging a collective.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from plait.mesh import Meshes, ParallelConfigError, ParallelDims

RESHARD_POLICIES = ("default", "always", "never")
REPLICATE_IMPLS = ("fsdp", "ddp")


@dataclass
class DataParallelConfig:
    """How parameters are sharded or replicated; which ranks do it is set by the degrees.

    param_dtype: dtype parameters are all-gathered in and compute runs in (e.g. torch.bfloat16);
        None keeps fp32. Applied by the sharding policy, never by autocast, when data parallel is on.
    reduce_dtype: dtype gradients are reduce-scattered / all-reduced in.
    reshard_after_forward: "default" (free every block's gathered parameters after its forward
        except the last block's and the root's, which backward needs at once), "always", "never",
        or an int k: keep them gathered over groups of k ranks after forward (k must divide the
        shard degree; 1 means never, the shard degree means always).
    cpu_offload: keep sharded parameters, gradients and optimizer state on the CPU.
    replicate_impl: with dp_replicate > 1 and dp_shard * cp == 1: "fsdp" (torch's FSDP-based
        `replicate`: DTensor parameters on the 1D replicate mesh, mixed precision by policy) or
        "ddp" (classic DistributedDataParallel; fp32 only).
    prefetch: explicitly prefetch the next block's all-gather in forward and the previous block's
        in backward (on top of FSDP's implicit prefetching).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype = torch.float32
    reshard_after_forward: str | int = "default"
    cpu_offload: bool = False
    replicate_impl: str = "fsdp"
    prefetch: bool = False


def data_parallel_mode(dims: ParallelDims, config: DataParallelConfig) -> str:
    """The mode the degrees give: "none", "fsdp", "hsdp", "replicate" (FSDP-based) or "ddp"."""
    shard = dims.dp_shard_cp > 1
    replicate = dims.dp_replicate > 1
    if shard:
        return "hsdp" if replicate else "fsdp"
    if replicate:
        return "ddp" if config.replicate_impl == "ddp" else "replicate"
    return "none"


def _is_float_dtype(value) -> bool:
    return isinstance(value, torch.dtype) and value.is_floating_point


def validate(
    model: nn.Module,
    meshes: Meshes,
    blocks: Sequence[str],
    config: DataParallelConfig,
    expert_modules: Sequence[str] = (),
    edge_units: Sequence[Sequence[str]] = (),
) -> str:
    """Check everything that can be checked locally; return the mode. Raises ParallelConfigError."""
    _validate_config(config)
    dims = meshes.dims
    mode = data_parallel_mode(dims, config)
    _validate_paths(model, blocks, expert_modules)
    _validate_edge_units(model, blocks, edge_units)
    if config.replicate_impl == "ddp" and dims.dp_shard_cp > 1:
        raise ParallelConfigError(
            f"data_parallel.replicate_impl = 'ddp' with dp_shard * cp = {dims.dp_shard_cp} > 1: DDP only "
            "replicates. Use replicate_impl = 'fsdp' (FSDP / HSDP shard over dp_shard * cp), or set "
            "parallelism.dp_shard = 1 and cp = 1 to replicate over dp_replicate."
        )
    if mode == "ddp":
        _validate_ddp(model, dims, config)
    if mode in ("fsdp", "hsdp"):
        _validate_reshard_degree(config.reshard_after_forward, "dp_shard * cp", dims.dp_shard_cp)
        if expert_modules and dims.ep > 1 and dims.efsdp > 1:
            _validate_reshard_degree(config.reshard_after_forward, "the expert FSDP degree (efsdp)", dims.efsdp)
    if mode != "none":
        _validate_meshes(meshes, mode)
    return mode


def _validate_config(config: DataParallelConfig) -> None:
    if config.param_dtype is not None and not _is_float_dtype(config.param_dtype):
        raise ParallelConfigError(
            f"data_parallel.param_dtype = {config.param_dtype!r}: use a floating dtype such as torch.bfloat16, "
            "or None to keep parameters in fp32."
        )
    if not _is_float_dtype(config.reduce_dtype):
        raise ParallelConfigError(
            f"data_parallel.reduce_dtype = {config.reduce_dtype!r}: use a floating dtype (torch.float32 is usual)."
        )
    raf = config.reshard_after_forward
    if isinstance(raf, bool) or not (raf in RESHARD_POLICIES or (isinstance(raf, int) and raf >= 1)):
        raise ParallelConfigError(
            f"data_parallel.reshard_after_forward = {raf!r}: use one of {', '.join(map(repr, RESHARD_POLICIES))} "
            "or a positive int that divides the shard degree."
        )
    if config.replicate_impl not in REPLICATE_IMPLS:
        raise ParallelConfigError(
            f"data_parallel.replicate_impl = {config.replicate_impl!r}: use 'fsdp' (torch's FSDP-based "
            "replicate) or 'ddp' (DistributedDataParallel)."
        )


def _validate_reshard_degree(raf: str | int, what: str, size: int) -> None:
    if isinstance(raf, int) and size % raf:
        divisors = [d for d in range(1, size + 1) if size % d == 0]
        raise ParallelConfigError(
            f"data_parallel.reshard_after_forward = {raf} must divide {what} = {size}: parameters are kept "
            f"gathered over groups of that many ranks. Use one of {divisors}, or 'default' / 'always' / 'never'."
        )


def _validate_edge_units(model: nn.Module, blocks: Sequence[str], edge_units: Sequence[Sequence[str]]) -> None:
    names = dict(model.named_modules())
    owners: dict[int, str] = {}
    for unit in edge_units:
        for path in unit:
            if path == "" or path not in names:
                raise ParallelConfigError(
                    f"edge unit module {path!r} is not a submodule of {type(model).__name__}: list paths as "
                    "model.named_modules() names them (model.parallel_info()['edge_units'])."
                )
            if any(path == b or path.startswith(b + ".") or b.startswith(path + ".") for b in blocks):
                raise ParallelConfigError(f"edge unit module {path!r} overlaps a block: edge units lie outside blocks.")
            for param in names[path].parameters():
                if owners.setdefault(id(param), path) != path:
                    raise ParallelConfigError(
                        f"edge unit modules {owners[id(param)]!r} and {path!r} share a parameter (tied weights): "
                        "put them in one unit or leave them to the root."
                    )


def _validate_paths(model: nn.Module, blocks: Sequence[str], expert_modules: Sequence[str]) -> None:
    names = dict(model.named_modules())
    for kind, paths in (("block", blocks), ("expert module", expert_modules)):
        seen = set()
        for path in paths:
            if path == "" or path not in names:
                near = [n for n in names if n and n.split(".")[-1] == path.split(".")[-1]][:3]
                hint = f" Modules with that name: {near}." if near else ""
                raise ParallelConfigError(
                    f"{kind} {path!r} is not a submodule of {type(model).__name__}.{hint} Pass paths as "
                    "model.named_modules() names them (model.parallel_info() lists them)."
                )
            if path in seen:
                raise ParallelConfigError(f"{kind} {path!r} is listed twice; list each module once.")
            seen.add(path)
    both = set(blocks) & set(expert_modules)
    if both:
        raise ParallelConfigError(
            f"{sorted(both)} are listed both as blocks and as expert modules; an expert module lives inside a block."
        )
    for path in blocks:
        for other in blocks:
            if other != path and other.startswith(path + "."):
                raise ParallelConfigError(
                    f"block {other!r} is nested in block {path!r}: blocks are disjoint units (one per layer)."
                )


def _validate_ddp(model: nn.Module, dims: ParallelDims, config: DataParallelConfig) -> None:
    others = {"cp": dims.cp, "tp": dims.tp, "ep": dims.ep}
    multi = {k: v for k, v in others.items() if v > 1}
    if multi:
        raise ParallelConfigError(
            f"data_parallel.replicate_impl = 'ddp' does not compose with {multi}: DistributedDataParallel takes "
            "plain tensors only. Use replicate_impl = 'fsdp', which handles DTensor parameters."
        )
    if config.param_dtype not in (None, torch.float32):
        raise ParallelConfigError(
            f"data_parallel.param_dtype = {config.param_dtype} with replicate_impl = 'ddp': DDP has no mixed "
            "precision policy (and autocast is not used under data parallel). Use replicate_impl = 'fsdp', "
            "or param_dtype = None."
        )
    if config.cpu_offload:
        raise ParallelConfigError(
            "data_parallel.cpu_offload = True with replicate_impl = 'ddp': DDP cannot offload. "
            "Use replicate_impl = 'fsdp'."
        )
    meta = [n for n, p in model.named_parameters() if p.is_meta]
    if meta:
        raise ParallelConfigError(
            f"replicate_impl = 'ddp' needs materialised parameters ({meta[0]} is on the meta device): DDP "
            "broadcasts them when it wraps. Call to_empty() and init_weights() first, or use replicate_impl = 'fsdp'."
        )


def _validate_meshes(meshes: Meshes, mode: str) -> None:
    if meshes.fsdp is None:
        raise ParallelConfigError(
            f"data parallel mode {mode!r} needs meshes built for these degrees ({meshes.dims}), but meshes.fsdp is "
            "None. Build them with plait.mesh.build_meshes(dims) on every rank after init_distributed()."
        )
