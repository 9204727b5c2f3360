"""Triton version of the permute-indices kernel (see `kernels.py` for the layout it produces).

One program per local expert. Each program reloads the whole (small) `[ep_degree, E_local]`
count matrix, derives its group's padded size and output offset plus every source segment's
start, then writes the source row ids of its group. Integer-only on purpose: it runs under
`TRITON_INTERPRET=1` on CPU exactly as on GPU, which is how CI tests it.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _permute_indices_kernel(
    counts_ptr,  # [ep_degree * num_local_experts] int32, (source rank, local expert) order
    permuted_ptr,  # [max_len] int64, pre-filled with -1
    m_sizes_ptr,  # [num_local_experts] int32
    m_offsets_ptr,  # [num_local_experts] int32
    ep_degree,
    num_local_experts,
    alignment,
    BLOCK_R: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
):
    e = tl.program_id(0)
    r_idx = tl.arange(0, BLOCK_R)
    e_idx = tl.arange(0, BLOCK_E)
    in_bounds = (r_idx[:, None] < ep_degree) & (e_idx[None, :] < num_local_experts)
    counts_RE = tl.load(counts_ptr + r_idx[:, None] * num_local_experts + e_idx[None, :], mask=in_bounds, other=0)

    # This expert's padded group: size and where it ends in the output.
    sizes_E = (tl.sum(counts_RE, axis=0) + alignment - 1) // alignment * alignment
    ends_E = tl.cumsum(sizes_E, axis=0)
    is_mine_E = e_idx == e
    my_size = tl.sum(tl.where(is_mine_E, sizes_E, 0), axis=0)
    my_end = tl.sum(tl.where(is_mine_E, ends_E, 0), axis=0)
    tl.store(m_sizes_ptr + e, my_size)
    tl.store(m_offsets_ptr + e, my_end)

    # Source starts: exclusive cumsum of the counts in row-major (rank, expert) order.
    row_totals_R = tl.sum(counts_RE, axis=1)
    row_start_R = tl.cumsum(row_totals_R, axis=0) - row_totals_R
    src_start_RE = row_start_R[:, None] + tl.cumsum(counts_RE, axis=1) - counts_RE
    src_start_R = tl.sum(tl.where(is_mine_E[None, :], src_start_RE, 0), axis=1)
    # Destination starts: this group's start plus the tokens of lower ranks for this expert.
    count_R = tl.sum(tl.where(is_mine_E[None, :], counts_RE, 0), axis=1)
    dst_start_R = my_end - my_size + tl.cumsum(count_R, axis=0) - count_R

    rows = tl.arange(0, BLOCK_ROWS)
    for r in range(0, ep_degree):
        is_r = r_idx == r
        count = tl.sum(tl.where(is_r, count_R, 0), axis=0)
        src = tl.sum(tl.where(is_r, src_start_R, 0), axis=0)
        dst = tl.sum(tl.where(is_r, dst_start_R, 0), axis=0)
        for j in range(0, count, BLOCK_ROWS):
            offs = j + rows
            tl.store(permuted_ptr + dst + offs, (src + offs).to(tl.int64), mask=offs < count)


def permute_indices_triton(
    tokens_per_expert_group: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    max_len: int,
    alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same contract as `kernels.permute_indices_torch`; launches one program per local expert."""
    device = tokens_per_expert_group.device
    counts = tokens_per_expert_group.to(torch.int32).contiguous()
    permuted = torch.full((max_len,), -1, dtype=torch.int64, device=device)
    m_sizes = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    m_offsets = torch.empty(num_local_experts, dtype=torch.int32, device=device)
    _permute_indices_kernel[(num_local_experts,)](
        counts,
        permuted,
        m_sizes,
        m_offsets,
        ep_degree,
        num_local_experts,
        alignment,
        BLOCK_R=triton.next_power_of_2(ep_degree),
        BLOCK_E=triton.next_power_of_2(num_local_experts),
        BLOCK_ROWS=128,
    )
    return permuted, m_sizes, m_offsets
