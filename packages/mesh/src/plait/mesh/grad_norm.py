"""Gradient norm and clipping over parameters that live on different meshes.

torch's `clip_grad_norm_` stacks every per-parameter norm into one tensor, which fails when plain
tensors, DTensors on a 1D FSDP mesh and DTensors on a 2D (ep, etp) mesh are mixed. Here gradients
are grouped by (mesh, placements), each group's norm is reduced over its own mesh, and the group
norms are combined into one global norm that every rank agrees on. Under pipeline parallel each
rank holds one stage's parameters only: pass `pp_mesh` and the stages' norms are combined too (one
all-reduce over pp), so every stage clips by the norm of the whole model.
"""

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor


def _group_key(grad: torch.Tensor):
    if isinstance(grad, DTensor):
        return (grad.device_mesh, tuple(grad.placements))
    return None


def _grads_by_group(parameters: Iterable[torch.Tensor]) -> dict:
    groups: dict = {}
    for p in parameters:
        if p.grad is not None:
            groups.setdefault(_group_key(p.grad), []).append(p.grad)
    return groups


def _group_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    # Accumulated in float64: an fp32 norm of a large gradient is off by ~1e-4 relative on CPU
    # (the whole output head of a small model), and by a different amount for each sharding,
    # which would make the same gradients report different norms under different layouts.
    if foreach is False:
        norms = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
    else:
        norms = torch._foreach_norm(grads, norm_type, dtype=torch.float64)
    norm = torch.linalg.vector_norm(torch.stack(list(norms)), norm_type)
    # A DTensor norm is Partial/Shard over its mesh; full_tensor reduces it there, once per group.
    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def grad_norm(
    parameters: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """The global gradient norm of `parameters`, whatever mesh each lives on (and over every
    pipeline stage when `pp_mesh` is given)."""
    return _total_norm(_grads_by_group(parameters), float(norm_type), foreach, pp_mesh)


def _total_norm(
    groups: dict, norm_type: float, foreach: bool | None, pp_mesh: DeviceMesh | None = None
) -> torch.Tensor:
    norms = [_group_norm(grads, norm_type, foreach) for grads in groups.values()]
    if not norms and pp_mesh is None:
        return torch.tensor(0.0)
    device = norms[0].device if norms else torch.device(pp_mesh.device_type)
    stacked = torch.stack([n.to(device) for n in norms]) if norms else torch.zeros(1, dtype=torch.float64, device=device)
    if math.isinf(norm_type):
        total = stacked.max()
        if pp_mesh is not None:
            dist.all_reduce(total, op=dist.ReduceOp.MAX, group=pp_mesh.get_group())
        return total.float()
    # A stage's sum of powers, summed over the stages, is the whole model's (a stage may hold none).
    powered = stacked.pow(norm_type).sum()
    if pp_mesh is not None:
        dist.all_reduce(powered, group=pp_mesh.get_group())
    return powered.pow(1.0 / norm_type).float()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    pp_mesh: DeviceMesh | None = None,
) -> torch.Tensor:
    """Clip every gradient in place by one global norm; return that norm (a plain tensor).

    Under pipeline parallel pass `pp_mesh` (`meshes.pp`): the norm is the whole model's, every stage
    clips by it.

    A non-finite norm is returned as it is (the trainer stops on it); with `error_if_nonfinite`
    it raises instead.
    """
    groups = _grads_by_group(list(parameters))
    total = _total_norm(groups, float(norm_type), foreach, pp_mesh)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm ({norm_type}) is {total.item()}: the gradients are non-finite.")
    for grads in groups.values():
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=foreach)
    return total
