"""Capacity-mode dispatch: a static, even-split all-to-all with no device-to-host sync.

Every (source rank, expert) pair gets `capacity` rows: rank r sends peer p a block
[E_local, capacity, D] whatever the routing, so the all-to-all needs no split sizes and the
layer never waits on the host. A token whose position within its expert exceeds the capacity is
dropped: it sends nothing and its routed output is zero (its weight is 0); `dropped` counts them
on the device. Unused rows are zeros, and a bias-free SwiGLU expert maps zeros to zeros, so with a
capacity above the largest load the result equals dropless dispatch exactly. The capacity comes
from a number of routed rows that must be the same on every ep rank, since the block sizes of
the all-to-all are never exchanged (a mismatch raises on gloo, hangs or corrupts on NCCL). It is
true by construction when `capacity_rows` is given (a config value, the same everywhere: the
rows a rank routes may then differ, only the drops change). Otherwise the capacity comes from the
rows this rank routes, and before the first all-to-all, and again whenever that count changes,
the ep ranks compare their counts (one small all-gather and host read, counted in `host_syncs`)
and raise a one-line error if they differ; a caller that guarantees equal rows (the trainer)
turns the check off.
"""

import math

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed._functional_collectives import all_to_all_single_autograd

from .dispatch import _CombineInFlight

# torch 2.13 renamed it (the old name warns on every call); the GPU machines' 2.11 has only the old one.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def capacity_per_expert(num_rows: int, num_experts: int, factor: float, alignment: int = 1) -> int:
    """Rows each (source rank, expert) pair may send: factor x the even share, at least 1, at most
    every row this rank routes (one expert can never receive more: a larger factor would only
    allocate padding, 393 GB at factor 1e6 for DeepSeek-V3 debug), rounded up to `alignment` so
    every expert group (ep x capacity rows) starts aligned for grouped_mm."""
    capacity = min(max(1, math.ceil(factor * num_rows / num_experts)), max(1, num_rows))
    return -(-capacity // alignment) * alignment


class CapacityDispatcher:
    """Moves tokens to the rank owning their expert with fixed-size blocks (no host sync)."""

    def __init__(
        self,
        group: dist.ProcessGroup,
        num_experts: int,
        capacity_factor: float,
        alignment: int = 1,
        capacity_rows: int | None = None,
        check_rows: bool = True,
        device: torch.device | str = "cpu",
    ):
        self.group = group
        self.ep = dist.get_world_size(group)
        self.num_experts = num_experts
        self.num_local_experts = num_experts // self.ep
        self.capacity_factor = capacity_factor
        self.alignment = alignment
        self.capacity_rows = capacity_rows  # fixed sizing rows (the same on every rank), or None
        self.check_rows = check_rows and capacity_rows is None
        self._rows_checked: int | None = None  # the row count last found equal on every ep rank
        self.host_syncs = 0  # only the row-count checks (none with capacity_rows; else once per count)
        # Device scalar: (token, choice) pairs dropped so far. A tensor from the start, so that a
        # compiled dispatch sees the same type on every call (None at first recompiled the block).
        self.dropped = torch.zeros((), dtype=torch.int64, device=device)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._deferred: list[tuple] = []  # a combine waiting for link_deferred()

    def dispatch(self, x_ND: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, capacity_rows: int | None = None):
        """`capacity_rows`: the row count the capacity is sized by when ranks route different
        counts (TP shares differing by one row, from `self.capacity_rows` when set); it must be the
        same on every ep rank."""
        N, D = x_ND.shape
        E, El, ep = self.num_experts, self.num_local_experts, self.ep
        rows = capacity_rows or self.capacity_rows or N
        if self.check_rows and rows != self._rows_checked:
            self._check_rows_equal(rows, x_ND.device)
        C = capacity_per_expert(rows, E, self.capacity_factor, self.alignment)
        # Row i belongs to expert e_i (rows are sorted by expert); its slot is its rank in the group.
        offsets_E = torch.cumsum(num_tokens_per_expert_E, 0) - num_tokens_per_expert_E
        expert_N = torch.repeat_interleave(
            torch.arange(E, device=x_ND.device), num_tokens_per_expert_E, output_size=N
        )
        position_N = torch.arange(N, device=x_ND.device) - offsets_E[expert_N]
        kept_N = position_N < C
        dropped_N = ~kept_N
        # Dropped rows -> a dump slot (masked_fill with a number: no device tensor made of it).
        slot_N = (expert_N * C + position_N).masked_fill(dropped_N, E * C)
        # Training forwards, not evaluation, nor an activation-checkpoint recomputation in backward.
        # Under torch.compile the graph task id cannot be traced (a graph break), and is not needed:
        # the count is a graph output applied once per call, a recomputation inside the compiled
        # backward does not apply it again.
        if torch.is_grad_enabled() and (torch.compiler.is_compiling() or torch._C._current_graph_task_id() == -1):
            self.dropped = self.dropped + dropped_N.sum()
        send = x_ND.new_zeros(E * C + 1, D).index_copy(0, slot_N, x_ND)[: E * C]  # [ep * El * C, D]
        received = all_to_all_single_autograd(send, None, None, self.group)  # [ep(src), El, C, D]
        # Expert-major for the grouped GEMM: [El, ep(src), C, D], every expert ep * C rows.
        x_padded = received.view(ep, El, C, D).transpose(0, 1).reshape(El * ep * C, D)
        m_sizes = torch.full((El,), ep * C, dtype=torch.int64, device=x_ND.device)
        self._pending.clear()  # left only by a recomputation stopped before the combine
        self._pending.append((slot_N, kept_N, C))
        return x_padded, m_sizes

    def _check_rows_equal(self, rows: int, device: torch.device) -> None:
        """Before the static all-to-all: every ep rank must size its blocks from the same rows."""
        mine = torch.tensor([rows], dtype=torch.int64, device=device)
        every = torch.empty(self.ep, dtype=torch.int64, device=device)
        _all_gather_flat(every, mine, group=self.group)
        counts = every.tolist()
        self.host_syncs += 1
        if len(set(counts)) != 1:
            raise ValueError(
                f"expert capacity mode: the ep ranks route different row counts {counts} (their all-to-all blocks "
                "would differ): give every rank the same local batch, or set ExpertParallelConfig.capacity_rows."
            )
        self._rows_checked = rows

    def combine(self, y_padded_PD: torch.Tensor, deferred: bool = False) -> torch.Tensor:
        """The local experts' outputs -> this rank's rows, in dispatch's input order (dropped rows
        zero). The rows come back in slot order and their gather into the caller's order needs the
        all-to-all's output, so the plain path waits here. `deferred` (as the dropless
        dispatcher's): the rows come back as a tensor still in flight, usable after
        `link_deferred()` (the overlapped module's forward hook) waits, gathers them and joins them
        to autograd. Not under torch.compile nor without autograd: the plain path there."""
        slot_N, kept_N, C = self._pending.pop()
        El, ep = self.num_local_experts, self.ep
        D = y_padded_PD.shape[-1]
        back = y_padded_PD.view(El, ep, C, D).transpose(0, 1).reshape(ep * El * C, D)
        if not deferred or not torch.is_grad_enabled() or torch.compiler.is_compiling():
            returned = all_to_all_single_autograd(back, None, None, self.group)  # [E * C, D], this rank's rows
            returned = torch.cat([returned, returned.new_zeros(1, D)])  # the dump slot reads zeros
            return returned[slot_N] * kept_N[:, None].to(returned.dtype)
        self.drop_deferred()  # one never linked was left by a recomputation stopped early
        even = [El * C] * ep  # the static blocks, both ways
        returned = torch.ops._c10d_functional.all_to_all_single(back.detach(), even, even, self.group.group_name)
        combined_ND = _CombineInFlight(returned, shape=torch.Size((slot_N.shape[0], D)))
        self._deferred.append((back, combined_ND, slot_N, kept_N))
        return combined_ND

    def link_deferred(self) -> None:
        """Wait for the deferred combine's rows, gather them and give them their autograd history
        (no-op when there is none)."""
        if self._deferred:
            back, combined_ND, slot_N, kept_N = self._deferred.pop()
            _LinkCapacityCombined.apply(back, combined_ND, slot_N, kept_N, self.group)

    def drop_deferred(self) -> int:
        """Wait for and forget an unlinked combine; returns how many there were."""
        for _, combined_ND, _, _ in self._deferred:
            torch.ops._c10d_functional.wait_tensor(combined_ND.buffer_ND)
        dropped, self._deferred = len(self._deferred), []
        return dropped


class _LinkCapacityCombined(torch.autograd.Function):
    """Capacity mode's deferred combine joined to autograd in place (dispatch.py's `_LinkCombined`
    with the gather by slot): forward waits for the all-to-all and gathers the rows into the
    tensor the caller holds; backward scatters the gradient to the slots and sends it back
    un-waited (the experts' backward, its first user, waits)."""

    @staticmethod
    def forward(ctx, back_SD, combined_ND, slot_N, kept_N, group):
        returned_SD = torch.ops._c10d_functional.wait_tensor(combined_ND.buffer_ND)
        returned_SD = torch.cat([returned_SD, returned_SD.new_zeros(1, returned_SD.shape[1])])  # dump slot: zeros
        combined_ND.buffer_ND = returned_SD[slot_N] * kept_N[:, None].to(returned_SD.dtype)
        combined_ND.linked = True
        ctx.save_for_backward(slot_N, kept_N)
        ctx.slots, ctx.group = back_SD.shape[0], group
        ctx.mark_dirty(combined_ND)
        return combined_ND

    @staticmethod
    def backward(ctx, grad_ND):
        slot_N, kept_N = ctx.saved_tensors
        grad_ND = grad_ND * kept_N[:, None].to(grad_ND.dtype)
        # Kept rows have distinct slots; dropped ones all go to the dump slot, cut off here.
        grad_SD = grad_ND.new_zeros(ctx.slots + 1, grad_ND.shape[1]).index_add_(0, slot_N, grad_ND)[: ctx.slots]
        back_SD = funcol.all_to_all_single(grad_SD.contiguous(), None, None, ctx.group)
        return back_SD, None, None, None, None
