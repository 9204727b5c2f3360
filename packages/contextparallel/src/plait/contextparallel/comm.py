"""The collectives context parallel needs, on the cp process group, in one place.

Every function takes and returns plain tensors; autograd is handled by the attention functions
that call them (each method's backward is written out, so its communication is explicit).
"""

import torch
import torch.distributed as dist

# gloo matches point-to-point messages by (peer, tag); NCCL ignores tags and matches by order,
# which is the same on every rank here. Forward K/V and backward dK/dV use their own tags.
KV_TAG, GRAD_TAG = 11, 12

# torch 2.13 names the flat collectives *_single (the *_tensor names warn there); torch <= 2.12,
# the GPU machines' 2.11 among them, has only the *_tensor names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """[...] on every rank -> [world, ...] (rank-major)."""
    x = x.contiguous()
    out = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    _all_gather_flat(out.flatten(0, 1), x, group=group)  # the backends gather along dim 0
    return out


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[world, ...] summed over ranks -> this rank's [...]."""
    x = x.contiguous()
    out = torch.empty(x.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_flat(out, x.flatten(0, 1), group=group)
    return out


def all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    """[world, ...]: slice i goes to rank i; the result's slice j came from rank j."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def pack(*tensors: torch.Tensor) -> torch.Tensor:
    """One flat buffer holding `tensors` back to back (one copy each), for one collective."""
    buf = torch.empty(sum(t.numel() for t in tensors), dtype=tensors[0].dtype, device=tensors[0].device)
    for view, t in zip(unpack(buf, [t.shape for t in tensors]), tensors):
        view.copy_(t)
    return buf


def unpack(buf: torch.Tensor, shapes) -> list[torch.Tensor]:
    """Views of `buf`'s last dim as tensors of `shapes`: contiguous for a flat `buf`, so the attention
    kernels get K and V dense, never as interleaved slices of a [K | V] buffer (torch's ring attention
    makes K/V contiguous for the CUDA flash kernels, which otherwise gave it a bad loss curve)."""
    views, start = [], 0
    for shape in shapes:
        n = 1
        for size in shape:
            n *= size
        views.append(buf[..., start : start + n].unflatten(-1, tuple(shape)))
        start += n
    return views


class RingShift:
    """Send a tensor to the next rank and receive the previous rank's, asynchronously."""

    def __init__(self, group, tag: int):
        self.group = group
        self.tag = tag
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (rank + 1) % world)
        self.prev = dist.get_global_rank(group, (rank - 1) % world)

    def start(self, send: torch.Tensor) -> "_Pending":
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, self.tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, self.tag),
        ]
        return _Pending(dist.batch_isend_irecv(ops), recv, send)


class _Pending:
    def __init__(self, works, recv: torch.Tensor, send: torch.Tensor):
        self.works, self.recv, self._send = works, recv, send  # keep `send` alive until done

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self._send = None
        return self.recv
