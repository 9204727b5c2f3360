"""Gradient norm and clipping over parameters that live on different meshes.

torch's `clip_grad_norm_` stacks every per-parameter norm into one tensor, which fails when plain
tensors, DTensors on a 1D FSDP mesh and DTensors on a 2D (ep, etp) mesh are mixed. Here gradients
are grouped by (mesh, placements), each group's norm is reduced over its own mesh, and the group
norms are combined into one global norm that every rank agrees on.
"""

import math
from collections.abc import Iterable

import torch
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
    parameters: Iterable[torch.Tensor], norm_type: float = 2.0, foreach: bool | None = None
) -> torch.Tensor:
    """The global gradient norm of `parameters`, whatever mesh each lives on."""
    return _total_norm(_grads_by_group(parameters), float(norm_type), foreach)


def _total_norm(groups: dict, norm_type: float, foreach: bool | None) -> torch.Tensor:
    norms = [_group_norm(grads, norm_type, foreach) for grads in groups.values()]
    if not norms:
        return torch.tensor(0.0)
    device = norms[0].device
    stacked = torch.stack([n.to(device) for n in norms])
    if math.isinf(norm_type):
        return stacked.max().float()
    return stacked.pow(norm_type).sum().pow(1.0 / norm_type).float()


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """Clip every gradient in place by one global norm; return that norm (a plain tensor).

    A non-finite norm is returned as it is (the trainer stops on it); with `error_if_nonfinite`
    it raises instead.
    """
    groups = _grads_by_group(list(parameters))
    total = _total_norm(groups, float(norm_type), foreach)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total gradient norm ({norm_type}) is {total.item()}: the gradients are non-finite.")
    for grads in groups.values():
        torch.nn.utils.clip_grads_with_norm_(grads, max_norm, total, foreach=foreach)
    return total
