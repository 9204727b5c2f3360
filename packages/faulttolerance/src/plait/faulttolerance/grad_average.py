"""The gradient average across replica groups: each rank averages its local gradients with the
same rank of every other group in the quorum.

Every group has the same layout (the same FSDP / TP / CP / EP / PP inside), so rank r of one group
holds the same shards as rank r of another: a DTensor gradient is averaged by its local shard, and
the DTensor keeps its placements. The within-group reduction (FSDP's reduce-scatter) has already
averaged over the group's own dp ranks, so the result is the mean over every rank of the quorum.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torchft.manager import Manager


def local_gradient(grad: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds of `grad`: a DTensor's local shard (sharing its storage)."""
    return grad.to_local() if isinstance(grad, DTensor) else grad


def gradient_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive gradients of one dtype and device, up to `bucket_bytes` a bucket (a larger
    gradient is a bucket of its own). Every group forms the same buckets from the same layout."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        last = buckets[-1] if buckets else None
        if last is None or (g.dtype, g.device) != (last[0].dtype, last[0].device) or size + nbytes > bucket_bytes:
            buckets.append([g])
            size = nbytes
        else:
            last.append(g)
            size += nbytes
    return buckets


def _flat(bucket: list[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer for the bucket: the gradient itself when it is alone and contiguous."""
    if len(bucket) == 1 and bucket[0].is_contiguous():
        return bucket[0].view(-1)
    return torch.cat([g.reshape(-1) for g in bucket])


def _copy_back(bucket: list[torch.Tensor], flat: torch.Tensor) -> None:
    if len(bucket) == 1 and flat.data_ptr() == bucket[0].data_ptr():
        return
    for g, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
        g.copy_(piece.view_as(g))


@torch.no_grad()
def average_gradients(manager: Manager, params: Iterable[torch.nn.Parameter], bucket_bytes: int) -> None:
    """Replace every parameter's local gradient by its mean over the quorum's replica groups.

    All buckets are issued before the first wait. A failed collective does not raise: torchft
    records it and the step's `should_commit()` is False on every group (the gradients are then
    garbage, and the caller zeroes them as after any step)."""
    grads = [local_gradient(p.grad) for p in params if p.grad is not None]
    in_flight = []
    for bucket in gradient_buckets(grads, bucket_bytes):
        flat = _flat(bucket)
        in_flight.append((bucket, flat, manager.allreduce(flat)))
    for bucket, flat, work in in_flight:
        work.wait()
        _copy_back(bucket, flat)
