"""The permute-indices kernel: (source rank, local expert) order -> expert-major, padded groups.

After expert parallel's dispatch all-to-all, a rank holds its tokens ordered by the rank they
came from, and within each source rank by local expert. `torch._grouped_mm` wants them ordered
by expert, and low-precision grouped GEMMs also want every group's row count to be a multiple of
an alignment (16 for fp8, 32 for mxfp8). This file computes, without any device-to-host sync
and into a static `max_len` buffer:

    permuted_indices [max_len] int64   source row of each output row, -1 for padding
    m_sizes          [num_local_experts] int32  padded group sizes (multiples of `alignment`)
    m_offsets        [num_local_experts] int32  cumulative ends (what grouped_mm's `offs` takes)

Output rows are expert-major: expert 0's tokens from rank 0, rank 1, ..., then its padding,
then expert 1, and so on; rows past `m_offsets[-1]` are padding too.

Three implementations with one signature: a Python-loop reference (readable, syncs), a
vectorised torch version (CPU and fallback) and a Triton kernel (CUDA, `triton_kernels.py`).
`generate_permute_indices` picks one; `permute_and_pad` / `unpermute` move the rows.
"""

import torch

# The group padding rule, one for every path (dropless EP, capacity EP, ep = 1) and both devices.
# What torch's CUDA `_grouped_mm` checks (aten/src/ATen/native/GroupedMMUtils.h
# `check_valid_strides_and_return_transposed`, cuda/GroupMMCommon.cuh `prepare_grouped_gemm_data`,
# torch/_meta_registrations.py `_meta_grouped_mm_common`): every operand's leading stride is a
# multiple of 16 bytes and its data pointer 16-byte aligned (so D and H * itemsize % 16 == 0);
# offs is 1-D int32; and, per group, `size % (16 / itemsize) == 0` (a device-side assert) whenever
# the token dimension is an operand's contiguous one (2D x 2D with a row-major A, 3D x 2D), because
# each group's start address must be 16-byte aligned for TMA. Eager autograd's layouts (x row-major
# forward, x.t() column-major for the weight gradient) never hit that assert, but a compiled graph
# may hand over a contiguous x^T, and the fp8 / mxfp8 grouped GEMMs require it (16 / 32 rows). So
# every group starts at a multiple of 16 bytes of rows: `16 // itemsize` rows for the dtype the
# GEMM runs in (bf16 / fp16: 8, fp32: 4, fp8: 16). The dtype is decided after the padding (FSDP's
# param_dtype, autocast inside the experts), so the paths use GROUP_ALIGNMENT = 8, the multiple of
# the rule for every unscaled dtype `_grouped_mm` takes (bf16, fp16, fp32). On the CPU too: the
# tensors a CPU test builds are the ones the CUDA kernel gets.


def group_alignment(dtype: torch.dtype) -> int:
    """Rows per group start that keep a grouped GEMM's group addresses 16-byte aligned."""
    return max(1, 16 // dtype.itemsize)


GROUP_ALIGNMENT = max(group_alignment(d) for d in (torch.bfloat16, torch.float16, torch.float32))


def default_max_len(num_rows: int, num_local_experts: int, alignment: int) -> int:
    """A static bound on the padded length: every group wastes at most `alignment - 1` rows."""
    bound = num_rows + num_local_experts * (alignment - 1)
    return -(-bound // alignment) * alignment


def _round_up(x: torch.Tensor, alignment: int) -> torch.Tensor:
    return (x + alignment - 1) // alignment * alignment


def permute_indices_reference(
    tokens_per_expert_group: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    max_len: int,
    alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Python loops over experts and ranks; the specification the other two are tested against."""
    counts = tokens_per_expert_group.tolist()
    # Where each (rank, expert) segment starts in the received buffer.
    src_start, pos = [], 0
    for c in counts:
        src_start.append(pos)
        pos += c
    permuted = [-1] * max_len
    m_sizes, m_offsets, out = [], [], 0
    for e in range(num_local_experts):
        start = out
        for r in range(ep_degree):
            seg = r * num_local_experts + e
            for j in range(counts[seg]):
                permuted[out] = src_start[seg] + j
                out += 1
        size = -(-(out - start) // alignment) * alignment
        out = start + size
        m_sizes.append(size)
        m_offsets.append(out)
    device = tokens_per_expert_group.device
    return (
        torch.tensor(permuted, dtype=torch.int64, device=device),
        torch.tensor(m_sizes, dtype=torch.int32, device=device),
        torch.tensor(m_offsets, dtype=torch.int32, device=device),
    )


def permute_indices_torch(
    tokens_per_expert_group: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    max_len: int,
    alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Vectorised: one searchsorted over segment starts instead of a loop over experts."""
    device = tokens_per_expert_group.device
    counts_RE = tokens_per_expert_group.to(torch.int64).view(ep_degree, num_local_experts)

    # Group sizes: tokens of local expert e from all ranks, rounded up to the alignment.
    m_sizes_E = _round_up(counts_RE.sum(dim=0), alignment)
    m_offsets_E = torch.cumsum(m_sizes_E, dim=0)
    group_start_E = m_offsets_E - m_sizes_E

    # Segment (r, e) starts, in the received (rank-major) buffer and in the output (expert-major).
    src_start_RE = (torch.cumsum(counts_RE.flatten(), 0) - counts_RE.flatten()).view_as(counts_RE)
    dst_start_RE = group_start_E[None, :] + torch.cumsum(counts_RE, dim=0) - counts_RE

    # Segments in output order are non-decreasing in dst start; an output row belongs to the last
    # segment starting at or before it (empty segments share their successor's start and lose).
    dst_start_S = dst_start_RE.t().flatten()
    src_start_S = src_start_RE.t().flatten()
    count_S = counts_RE.t().flatten()
    row_P = torch.arange(max_len, device=device)
    seg_P = torch.searchsorted(dst_start_S, row_P, right=True) - 1
    within_P = row_P - dst_start_S[seg_P]
    # masked_fill with a number, not `where`: no device tensor made of the number (a launch).
    is_padding_P = within_P >= count_S[seg_P]
    permuted_P = (src_start_S[seg_P] + within_P).masked_fill(is_padding_P, -1)
    return permuted_P, m_sizes_E.to(torch.int32), m_offsets_E.to(torch.int32)


def _triton_usable(t: torch.Tensor) -> bool:
    if not t.is_cuda:
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def generate_permute_indices(
    tokens_per_expert_group: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    max_len: int,
    alignment: int = 1,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(permuted_indices [max_len], m_sizes [E_local], m_offsets [E_local]); Triton on CUDA."""
    if tokens_per_expert_group.numel() != ep_degree * num_local_experts:
        raise ValueError(f"expected {ep_degree} x {num_local_experts} counts, got {tokens_per_expert_group.numel()}")
    if _triton_usable(tokens_per_expert_group):
        from .triton_kernels import permute_indices_triton

        return permute_indices_triton(tokens_per_expert_group, ep_degree, num_local_experts, max_len, alignment)
    return permute_indices_torch(tokens_per_expert_group, ep_degree, num_local_experts, max_len, alignment)


def permute_and_pad(
    x_ND: torch.Tensor,
    tokens_per_expert_group: torch.Tensor,
    ep_degree: int,
    num_local_experts: int,
    alignment: int = 1,
    max_len: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reorder received rows expert-major with aligned groups.

    Returns `(x_padded_PD, permuted_indices_P, m_sizes_E)`: feed `x_padded_PD, m_sizes_E` to
    `GroupedExperts`, then `unpermute(y_padded_PD, permuted_indices_P, N)` to restore the order.
    Padding rows are zeros and take no gradient back to `x_ND`.
    """
    N = x_ND.shape[0]
    if max_len is None:
        max_len = default_max_len(N, num_local_experts, alignment)
    permuted_P, m_sizes_E, _ = generate_permute_indices(
        tokens_per_expert_group, ep_degree, num_local_experts, max_len, alignment
    )
    # Padding reads an appended zero row, so the gather needs no mask and no sync.
    x_ext_ND = torch.cat([x_ND, x_ND.new_zeros(1, x_ND.shape[1])])
    gather_P = permuted_P.masked_fill(permuted_P < 0, N)
    return x_ext_ND[gather_P], permuted_P, m_sizes_E


def unpermute(y_padded_PD: torch.Tensor, permuted_indices_P: torch.Tensor, num_rows: int) -> torch.Tensor:
    """Inverse of `permute_and_pad`: row `permuted_indices_P[p]` of the result is `y_padded_PD[p]`."""
    P = permuted_indices_P.shape[0]
    # Invert the permutation with one scatter (every real row is hit exactly once; padding all
    # lands on a dump slot), then gather: deterministic, and padding rows are never read.
    target_P = permuted_indices_P.masked_fill(permuted_indices_P < 0, num_rows)
    inverse_N = torch.zeros(num_rows + 1, dtype=torch.int64, device=permuted_indices_P.device)
    inverse_N.scatter_(0, target_P, torch.arange(P, device=permuted_indices_P.device))
    return y_padded_PD[inverse_N[:num_rows]]
