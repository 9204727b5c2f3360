"""FSDP and HSDP with FSDP2's `fully_shard`: routed experts first, then each block, then the root.

One function, `shard_module`, shards a module over whichever mesh it is given: a 1D mesh is FSDP,
a 2D (replicate, shard) mesh is HSDP. Routed experts go over `meshes.expert_fsdp`, everything else
over `meshes.fsdp`; parameters that are already DTensors (tensor / expert parallel) compose because
every mesh is a view of the one world mesh. When ep takes all of dp_shard x cp there is nothing
left to shard experts over: they are replicated over dp_replicate, or, without it, left to EP.
"""

import weakref
from collections.abc import Sequence

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Shard

from plait.mesh import Meshes, collectives_on_gloo

from .config import DataParallelConfig
from .cpu_overlap import overlap_on_cpu
from .gloo_bytes import ByteAllGather
from .precision import mixed_precision_policy, offload_policy


def _shard_size(mesh: DeviceMesh) -> int:
    """Ranks a parameter is sharded over: the last axis (the first is replicate under HSDP)."""
    return mesh.size(mesh.ndim - 1)


def _reshard(policy: str | int, shard_size: int, *, last: bool) -> bool | int:
    """The `reshard_after_forward` one unit gets. `last`: the last block or the root, which
    backward needs at once, so "default" keeps them gathered."""
    if policy == "always":
        return True
    if policy == "never":
        return False
    if policy == "default":
        return not last
    # An int: 1 rank is no resharding, the whole shard group is plain resharding.
    if policy == 1:
        return False
    if policy == shard_size:
        return True
    return policy


def _expert_placement_fn(shard_size: int):
    """Shard experts' weights [E, in, out] on dim 1 when there are fewer local experts than ranks.

    With expert parallel the local E can be smaller than the expert-FSDP degree; Shard(0) would then
    leave ranks with nothing (and uneven padding), so shard the next dim when it divides evenly.
    """

    def placement(param: nn.Parameter) -> Shard | None:
        local = param.to_local() if isinstance(param, DTensor) else param
        if local.ndim >= 2 and local.shape[0] < shard_size and local.shape[1] % shard_size == 0:
            return Shard(1)
        return None

    return placement


def shard_module(
    module: nn.Module | list[nn.Module],
    mesh: DeviceMesh,
    config: DataParallelConfig,
    reshard_after_forward: bool | int,
    *,
    experts: bool = False,
    gradient_divide_factor: float | None = None,
    ignored_params: set[nn.Parameter] | None = None,
) -> FSDPModule:
    """fully_shard one unit over `mesh` (1D: FSDP, 2D: HSDP) with the config's policies."""
    fully_shard(
        module,
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        shard_placement_fn=_expert_placement_fn(_shard_size(mesh)) if experts else None,
        mp_policy=mixed_precision_policy(config),
        offload_policy=offload_policy(config, mesh.device_type),
        ignored_params=ignored_params or None,
    )
    if gradient_divide_factor is not None:
        module.set_gradient_divide_factor(gradient_divide_factor)
    if collectives_on_gloo(mesh):
        reduce_on_gloo(module, mesh, custom_factor=gradient_divide_factor is not None)
    return module


def reduce_on_gloo(module: FSDPModule | list, mesh: DeviceMesh, custom_factor: bool = False) -> None:
    """Gloo's collectives (CPU, or CUDA ranks sharing a GPU): float8 weights gathered as bytes
    (gloo has no float8 type), and reductions as SUM with FSDP dividing where gloo would be asked
    for more: a custom factor becomes PREMUL_SUM, which gloo does not have; on CUDA tensors gloo's
    reduce-scatter is an all-reduce of a copy, whose AVG support differs between torch versions.
    (On CPU plait's all-to-all reduce-scatter averages itself: cpu_overlap.py.)"""
    for unit in module if isinstance(module, list) else [module]:
        unit.set_custom_all_gather(ByteAllGather())
        if custom_factor or mesh.device_type != "cpu":
            unit.set_force_sum_reduction_for_comms(True)


def _block_of(path: str, blocks: Sequence[str]) -> str | None:
    for block in blocks:
        if path.startswith(block + "."):
            return block
    return None


def _expert_placement(meshes: Meshes) -> tuple[str, DeviceMesh | None, float | None]:
    """How routed experts are data-parallel: ("shard" | "replicate" | "none", mesh, gradient factor).

    With ep > 1 experts see tokens from their whole ep group but are reduced only over the expert
    mesh, so their gradients are divided by every rank that contributed a loss (dp_replicate *
    dp_shard * cp), as the non-expert parameters are. When ep takes all of dp_shard x cp (efsdp 1)
    only dp_replicate is left: replicate them there, or, without it, leave them to expert parallel.
    Without ep they are ordinary parameters on meshes.fsdp.
    """
    dims = meshes.dims
    if dims.ep == 1:
        return "shard", meshes.fsdp, None
    factor = float(dims.dp_cp)
    if dims.efsdp > 1:
        return "shard", meshes.expert_fsdp, factor
    if dims.dp_replicate > 1:
        return "replicate", meshes.dp_replicate, factor
    return "none", None, factor


def apply_fsdp(
    model: nn.Module,
    meshes: Meshes,
    blocks: Sequence[str],
    config: DataParallelConfig,
    expert_modules: Sequence[str] = (),
    edge_units: Sequence[Sequence[str]] = (),
) -> nn.Module:
    modules = dict(model.named_modules())
    dense_mesh = meshes.fsdp
    last_block = blocks[-1] if blocks else None
    # Experts first: fully_shard claims every parameter not already claimed by a submodule, so the
    # innermost units go first and their block / the root skip their parameters.
    experts_by_block, ignored = _apply_to_experts(model, meshes, blocks, config, expert_modules)
    units = []
    for path in blocks:
        reshard = _reshard(config.reshard_after_forward, _shard_size(dense_mesh), last=path == last_block)
        units.append(shard_module(modules[path], dense_mesh, config, reshard, ignored_params=ignored))
    edges = []
    for i, unit in enumerate(edge_units):
        # The last edge unit (the output head) runs last in forward and first in backward: like the
        # last block it stays gathered in between; the others (the embedding) reshard after use.
        reshard = _reshard(config.reshard_after_forward, _shard_size(dense_mesh), last=i == len(edge_units) - 1)
        group = [modules[path] for path in unit]
        shard_module(group if len(group) > 1 else group[0], dense_mesh, config, reshard, ignored_params=ignored)
        edges.append(group[0])  # a group shares one FSDP state: any of its modules reaches it
    root_reshard = _reshard(config.reshard_after_forward, _shard_size(dense_mesh), last=True)
    shard_module(model, dense_mesh, config, root_reshard, ignored_params=ignored)
    if config.prefetch:
        # Edge units in forward order: all but the last (the head) run before the blocks.
        chain = [[e] for e in edges[:-1]] + [[u, *experts_by_block.get(b, [])] for u, b in zip(units, blocks)]
        _set_prefetch(chain + [[e] for e in edges[-1:]])
    if dense_mesh.device_type == "cpu":
        # No streams on CPU: gloo's collectives block the training thread unless issued async.
        kind, expert_mesh, _ = _expert_placement(meshes)
        sharded_experts = kind == "shard" and expert_mesh.ndim == 1
        experts = [u for us in experts_by_block.values() for u in us] if sharded_experts else []
        # HSDP all-reduces right after the reduce-scatter: only 1D meshes can defer it.
        dense = [*units, *edges, model] if dense_mesh.ndim == 1 else []
        overlap_on_cpu(model, [*experts, *dense])
    return model


def _apply_to_experts(model, meshes, blocks, config, expert_modules):
    """Shard (or replicate, or leave to EP) each expert module; return its units by block, and the
    parameters the dense units must ignore."""
    modules = dict(model.named_modules())
    kind, mesh, factor = _expert_placement(meshes)
    last_block = blocks[-1] if blocks else None
    by_block: dict[str | None, list[FSDPModule]] = {}
    left_to_ep = []
    for path in expert_modules:
        block = _block_of(path, blocks)
        if kind == "none":
            # Each expert lives on one rank of its ep group: nothing to shard or replicate. Keep
            # FSDP's hands off it but still scale its gradient like the rest.
            left_to_ep.append(modules[path])
            continue
        if kind == "replicate":
            unit = replicate(
                modules[path],
                mesh=mesh,
                mp_policy=mixed_precision_policy(config),
                offload_policy=offload_policy(config, mesh.device_type),
            )
            # replicate averages over dp_replicate; the rest of dp_cp is divided after the all-reduce.
            # (Not set_gradient_divide_factor: torch 2.13 applies a custom factor twice when there
            # is no reduce-scatter, once in place of it and once after the all-reduce.)
            unit.set_all_reduce_hook(_divide_in_place(factor / mesh.size()))
            if collectives_on_gloo(mesh) and mesh.device_type != "cpu":
                unit.set_force_sum_reduction_for_comms(True)
        else:
            last = block is None or block == last_block
            reshard = _reshard(config.reshard_after_forward, _shard_size(mesh), last=last)
            unit = shard_module(modules[path], mesh, config, reshard, experts=True, gradient_divide_factor=factor)
        by_block.setdefault(block, []).append(unit)
    if left_to_ep:
        model.register_forward_pre_hook(_GradScale(left_to_ep, factor))
    return by_block, {p for m in left_to_ep for p in m.parameters()}


def _divide_in_place(factor: float):
    def hook(reduced: torch.Tensor) -> None:
        reduced.div_(factor)

    return hook


class _GradScale:
    """Divide the gradients of `modules`' parameters by `factor`, as FSDP would have.

    Attached from the root's forward pre-hook to whatever Parameter objects the modules hold at
    that time, once per object: `to_empty` / `load_state_dict(assign=True)` replace parameters, and
    a hook registered at wrap time would stay on the old ones. The root is never compiled per
    block, so registering there stays out of compiled regions.
    """

    def __init__(self, modules: list[nn.Module], factor: float):
        self.modules, self.factor = modules, factor
        # id -> weak reference: identity, not Tensor.__eq__, decides whether a parameter is hooked.
        self.hooked: dict[int, weakref.ref] = {}

    def __call__(self, root: nn.Module, args) -> None:
        for module in self.modules:
            for param in module.parameters():
                seen = self.hooked.get(id(param))
                if param.requires_grad and (seen is None or seen() is not param):
                    param.register_hook(self._divide)
                    self.hooked[id(param)] = weakref.ref(param)

    def _divide(self, grad):
        return grad / self.factor


def _set_prefetch(groups: list[list[FSDPModule]]) -> None:
    """`groups` in forward order (a unit and the expert units inside it). Forward: each unit issues
    the next group's all-gathers; backward: the previous group's."""
    for i, (unit, *_) in enumerate(groups):
        if i + 1 < len(groups):
            unit.set_modules_to_forward_prefetch(groups[i + 1])
        if i > 0:
            unit.set_modules_to_backward_prefetch(groups[i - 1])
