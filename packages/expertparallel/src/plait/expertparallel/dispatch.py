"""Dropless all-to-all token dispatch and combine for one routed-experts module.

    dispatch: counts [ep, E_local] --all-to-all--> counts received from every source rank
              split sizes of both directions --one device-to-host copy-->
              tokens --all-to-all (uneven, autograd)--> rows grouped (source rank, local expert)
              --permute kernel--> expert-major, groups padded to the kernel's alignment
    experts:  the module's own forward on its local experts
    combine:  unpermute --all-to-all back (autograd)--> rows in the order they came in

With a module to overlap (`combine(..., deferred=True)`, then `link_deferred()` from that module's
forward hook), the combine's autograd node is created after that module ran: the autograd engine
runs the highest sequence number first, so in backward the combine's reverse all-to-all is issued,
un-waited, before that module's backward, which then hides it (`_LinkCombined`).

The split sizes are the only values that must reach the host (the all-to-all takes them as Python
ints): one transfer per MoE layer and micro-batch, counted in `host_syncs`. Also under activation
checkpointing: a checkpointed forward leaves its split sizes (and the received counts) in a FIFO,
and the recomputation in backward takes them from there instead of exchanging counts and syncing
again. An entry leaves the FIFO when backward passes the dispatch, so micro-batches whose
backwards run in forward order (gradient accumulation, pipeline schedules) each find their own.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.utils._pytree import tree_map_only


@dataclass
class _Routed:
    permuted_indices_P: torch.Tensor
    num_received: int
    input_splits: list[int]
    output_splits: list[int]


@dataclass
class _Splits:
    received_RE: torch.Tensor
    input_splits: list[int]
    output_splits: list[int]


def _in_backward() -> bool:
    # An activation-checkpoint recomputation runs inside the autograd engine's graph task.
    return torch._C._current_graph_task_id() != -1


def _checkpointed() -> bool:
    # Non-reentrant checkpointing packs saved tensors through saved-tensor hooks.
    return torch._C._autograd._top_saved_tensors_default_hooks(True) is not None


class _ReleaseOnBackward(torch.autograd.Function):
    """Identity whose backward drops the oldest FIFO entry: that forward's backward is done with it."""

    @staticmethod
    def forward(ctx, x_ND, fifo):
        ctx.fifo = fifo
        return x_ND.view_as(x_ND)

    @staticmethod
    def backward(ctx, grad_ND):
        if ctx.fifo:
            ctx.fifo.popleft()
        return grad_ND, None


class _CombineInFlight(torch.Tensor):
    """The deferred combine's rows while the all-to-all fills them. Before `link_deferred()` any
    use is an error (it would read a buffer still being written, with no gradient path); after
    it, every op runs on the rows themselves."""

    @staticmethod
    def __new__(cls, buffer_ND: torch.Tensor, shape: torch.Size | None = None):
        """`buffer_ND`: the rows being filled; or, with `shape`, any tensor of their dtype and
        device, and the link sets the rows (capacity mode gathers them from the all-to-all's output)."""
        shape = buffer_ND.shape if shape is None else shape
        t = torch.Tensor._make_wrapper_subclass(
            cls, shape, strides=torch.empty(shape, device="meta").stride(), dtype=buffer_ND.dtype,
            device=buffer_ND.device,
        )
        t.buffer_ND, t.linked = buffer_ND, False
        return t

    def __repr__(self):
        return f"_CombineInFlight(linked={self.linked}, {self.buffer_ND!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        def rows(t):
            if not t.linked:
                raise RuntimeError(
                    f"expert parallel: the routed experts' output was used ({func}) before the module named to "
                    "overlap the combine (overlap_modules) ran: run that module after the experts and before their "
                    "output is first used, or drop it from overlap_modules."
                )
            return t.buffer_ND

        args, kwargs = tree_map_only(cls, rows, (args, kwargs or {}))
        return func(*args, **kwargs)


class _LinkCombined(torch.autograd.Function):
    """The combine's all-to-all, already issued on a detached input, joined to autograd in place.

    Forward waits for the output buffer the caller already holds and marks it as this node's
    output; backward sends the gradient back and returns it un-waited (the experts' backward, its
    first user, waits). Created from the overlapped module's forward hook, this node runs in
    backward before that module's backward, which overlaps the reverse all-to-all."""

    @staticmethod
    def forward(ctx, y_received_ND, combined_ND, input_splits, output_splits, group):
        ctx.splits, ctx.group = (input_splits, output_splits), group
        torch.ops._c10d_functional.wait_tensor(combined_ND.buffer_ND)
        combined_ND.linked = True
        ctx.mark_dirty(combined_ND)
        return combined_ND

    @staticmethod
    def backward(ctx, grad_ND):
        input_splits, output_splits = ctx.splits  # the dispatch's: the gradient goes the dispatch's way
        back_ND = funcol.all_to_all_single(grad_ND.contiguous(), output_splits, input_splits, ctx.group)
        return back_ND, None, None, None, None


@dataclass
class _Deferred:
    y_received_ND: torch.Tensor
    combined_ND: _CombineInFlight
    routed: _Routed


class AllToAllDispatcher:
    """Moves a routed-experts module's tokens to the ep rank that owns their expert, and back."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        permute_and_pad: Callable,
        unpermute: Callable,
        alignment: int = 1,
    ):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.permute_and_pad, self.unpermute, self.alignment = permute_and_pad, unpermute, alignment
        self.host_syncs = 0  # device-to-host transfers so far (one per forward dispatch)
        self._pending: list[_Routed] = []
        self._splits: deque[_Splits] = deque()  # checkpointed forwards' split sizes, oldest first
        self._deferred: list[_Deferred] = []  # a combine waiting for link_deferred()

    def dispatch(self, x_ND: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, capacity_rows: int | None = None):
        """Rows sorted by global expert + counts [E] -> (rows for the local experts, their counts).
        (`capacity_rows` is the capacity mode's; dropless sends every row.)"""
        if _in_backward() and self._splits:
            # Recomputation under activation checkpointing: the forward's sizes, no sync, no exchange.
            splits = self._splits[0]
        else:
            counts_RE = num_tokens_per_expert_E.view(self.ep, self.num_local_experts)  # [ep, E_local]
            received_RE = torch.empty_like(counts_RE)
            dist.all_to_all_single(received_RE, counts_RE.contiguous(), group=self.group)
            # Both directions' split sizes in one copy: the only host sync of the layer.
            input_splits, output_splits = torch.stack([counts_RE.sum(1), received_RE.sum(1)]).tolist()
            self.host_syncs += 1
            splits = _Splits(received_RE, input_splits, output_splits)
            # Kept only where the backward that releases it will run (x_ND takes a gradient).
            if torch.is_grad_enabled() and x_ND.requires_grad and _checkpointed() and not _in_backward():
                self._splits.append(splits)
                x_ND = _ReleaseOnBackward.apply(x_ND, self._splits)
        received_RE, input_splits, output_splits = splits.received_RE, splits.input_splits, splits.output_splits
        received_ND = all_to_all_single_autograd(x_ND, output_splits, input_splits, self.group)
        x_padded_PD, permuted_indices_P, m_sizes_E = self.permute_and_pad(
            received_ND, received_RE.flatten(), self.ep, self.num_local_experts, self.alignment
        )
        # Dispatch and combine of one dispatcher always alternate; an entry still here was left by a
        # recomputation that checkpointing stopped early (before the combine): drop it.
        self._pending.clear()
        self._pending.append(_Routed(permuted_indices_P, received_ND.shape[0], input_splits, output_splits))
        return x_padded_PD, m_sizes_E

    def combine(self, y_padded_PD: torch.Tensor, deferred: bool = False) -> torch.Tensor:
        """The local experts' outputs -> rows back on their source ranks, in dispatch's input order.
        Handed back un-waited (an AsyncCollectiveTensor waits at its first use; on CUDA the NCCL
        stream runs meanwhile): work the caller does before using it, the MoE block's shared
        experts, overlaps with the all-to-all.

        `deferred`: the rows come back as a tensor the all-to-all is still filling, with no
        autograd history and unusable until `link_deferred()` (the overlapped module's forward
        hook) waits for it and joins it to autograd, so the backward overlaps too. Not under
        torch.compile (the compiled graph orders its own backward) nor without autograd: the plain
        path there."""
        routed = self._pending.pop()
        y_received_ND = self.unpermute(y_padded_PD, routed.permuted_indices_P, routed.num_received)
        if not deferred or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            return all_to_all_single_autograd(y_received_ND, routed.input_splits, routed.output_splits, self.group)
        # A combine never linked was left by a recomputation that checkpointing stopped early.
        self.drop_deferred()
        combined_ND = _CombineInFlight(
            torch.ops._c10d_functional.all_to_all_single(
                y_received_ND.detach(), routed.input_splits, routed.output_splits, self.group.group_name
            )
        )
        self._deferred.append(_Deferred(y_received_ND, combined_ND, routed))
        return combined_ND

    def link_deferred(self) -> None:
        """Wait for the deferred combine's rows and give them their autograd history (no-op when
        there is none: not deferred, compiled, or no autograd)."""
        if self._deferred:
            d = self._deferred.pop()
            _LinkCombined.apply(d.y_received_ND, d.combined_ND, d.routed.input_splits, d.routed.output_splits, self.group)

    def drop_deferred(self) -> int:
        """Wait for and forget an unlinked combine; returns how many there were."""
        for d in self._deferred:
            torch.ops._c10d_functional.wait_tensor(d.combined_ND.buffer_ND)
        dropped, self._deferred = len(self._deferred), []
        return dropped
