"""A sync-free grouped GEMM in Triton, for where torch's CUDA `_grouped_mm` is not.

torch's CUDA `_grouped_mm` has a fast CUTLASS path only for bf16 on sm90 / sm100; everything else
(fp32, fp16, bf16 below Hopper) goes to `_grouped_mm_fallback`, which copies `offs` to the host
(`offs.cpu()`) and loops over groups: one device-to-host sync on every call, 3 per MoE layer
forward and 6 backward. These two kernels read the group ends on the device instead:

    grouped_mm_rows   y[rows of g] = x[rows of g] @ w[g]          (forward, and dx with w^T)
    grouped_mm_wgrad  dw[g] = x[rows of g]^T @ dy[rows of g]       (the weight gradient)

Same contract as `torch._grouped_mm(x_2D, w_3D, offs=offs)` (int32 cumulative group ends, rows
past the last end are left zero). fp32 dots run in IEEE fp32 (no TF32), so an fp32 run stays an
fp32 run. Integer/float both run under `TRITON_INTERPRET=1` on CPU, which is how CI tests them.
"""

import torch
import triton
import triton.language as tl


@triton.jit
def _rows_kernel(
    x_ptr, w_ptr, y_ptr, offs_ptr, G, K, N,
    sxm, sxk, swg, swk, swn, sym, syn,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    # Program (tile, n-block): tiles are numbered group by group, each group ceil(rows / BM) tiles.
    tile = tl.program_id(0)
    pid_n = tl.program_id(1)
    group = -1
    row_start = 0
    row_end = 0
    first_tile = 0
    prev_end = 0
    for g in range(0, G):
        end = tl.load(offs_ptr + g)
        n_tiles = (end - prev_end + BM - 1) // BM
        hit = (tile >= first_tile) & (tile < first_tile + n_tiles)
        group = tl.where(hit, g, group)
        row_start = tl.where(hit, prev_end + (tile - first_tile) * BM, row_start)
        row_end = tl.where(hit, end, row_end)
        first_tile += n_tiles
        prev_end = end
    if group >= 0:
        rows = row_start + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + ks
            a = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :] * sxk,
                        mask=(rows[:, None] < row_end) & (kk[None, :] < K), other=0.0)  # fmt: skip
            b = tl.load(w_ptr + group * swg + kk[:, None] * swk + cols[None, :] * swn,
                        mask=(kk[:, None] < K) & (cols[None, :] < N), other=0.0)  # fmt: skip
            if IEEE:
                acc += tl.dot(a, b, input_precision="ieee")
            else:
                acc += tl.dot(a, b)
        tl.store(y_ptr + rows[:, None] * sym + cols[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=(rows[:, None] < row_end) & (cols[None, :] < N))  # fmt: skip


@triton.jit
def _wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offs_ptr, K, N,
    sxm, sxk, sdm, sdn, swg, swk, swn,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    g = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    end = tl.load(offs_ptr + g)
    start = tl.load(offs_ptr + g - 1, mask=g > 0, other=0)
    ks = pid_k * BK + tl.arange(0, BK)
    cols = pid_n * BN + tl.arange(0, BN)
    ms = tl.arange(0, BM)
    acc = tl.zeros((BK, BN), dtype=tl.float32)
    for m0 in range(start, end, BM):
        rows = m0 + ms
        a = tl.load(x_ptr + rows[None, :] * sxm + ks[:, None] * sxk,
                    mask=(rows[None, :] < end) & (ks[:, None] < K), other=0.0)  # fmt: skip
        b = tl.load(dy_ptr + rows[:, None] * sdm + cols[None, :] * sdn,
                    mask=(rows[:, None] < end) & (cols[None, :] < N), other=0.0)  # fmt: skip
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    tl.store(dw_ptr + g * swg + ks[:, None] * swk + cols[None, :] * swn, acc.to(dw_ptr.dtype.element_ty),
             mask=(ks[:, None] < K) & (cols[None, :] < N))  # fmt: skip


_BM, _BN, _BK = 32, 32, 32


def grouped_mm_rows(x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """`torch._grouped_mm(x_MK, w_GKN, offs=offs_G)` without a host sync; `w_GKN` may be a view."""
    M, K = x_MK.shape
    G, _, N = w_GKN.shape
    y_MN = torch.zeros(M, N, dtype=x_MK.dtype, device=x_MK.device)
    # A static bound on the tiles: every group wastes at most one partial tile.
    grid = (triton.cdiv(M, _BM) + G, triton.cdiv(N, _BN))
    _rows_kernel[grid](
        x_MK, w_GKN, y_MN, offs_G, G, K, N, *x_MK.stride(), *w_GKN.stride(), *y_MN.stride(),
        IEEE=x_MK.dtype == torch.float32, BM=_BM, BN=_BN, BK=_BK,
    )  # fmt: skip
    return y_MN


def grouped_mm_wgrad(x_MK: torch.Tensor, dy_MN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    """`dw[g] = x[rows of g]^T @ dy[rows of g]`, `[G, K, N]`, zero for empty groups."""
    K, N, G = x_MK.shape[1], dy_MN.shape[1], offs_G.shape[0]
    dw_GKN = torch.empty(G, K, N, dtype=x_MK.dtype, device=x_MK.device)
    grid = (G, triton.cdiv(K, _BK), triton.cdiv(N, _BN))
    _wgrad_kernel[grid](
        x_MK, dy_MN, dw_GKN, offs_G, K, N, *x_MK.stride(), *dy_MN.stride(), *dw_GKN.stride(),
        IEEE=x_MK.dtype == torch.float32, BM=_BM, BN=_BN, BK=_BK,
    )  # fmt: skip
    return dw_GKN


class TritonGroupedMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_MK, w_GKN, offs_G):
        ctx.save_for_backward(x_MK, w_GKN, offs_G)
        return grouped_mm_rows(x_MK, w_GKN, offs_G)

    @staticmethod
    def backward(ctx, dy_MN):
        x_MK, w_GKN, offs_G = ctx.saved_tensors
        dx = grouped_mm_rows(dy_MN, w_GKN.transpose(1, 2), offs_G) if ctx.needs_input_grad[0] else None
        dw = grouped_mm_wgrad(x_MK, dy_MN, offs_G) if ctx.needs_input_grad[1] else None
        return dx, dw, None


def triton_grouped_mm(x_MK: torch.Tensor, w_GKN: torch.Tensor, offs_G: torch.Tensor) -> torch.Tensor:
    return TritonGroupedMM.apply(x_MK, w_GKN, offs_G)
