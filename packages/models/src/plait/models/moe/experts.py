"""Routed experts: E SwiGLU MLPs computed together with `torch._grouped_mm`.

Weights are stacked `[E, in, out]` so a token block multiplies them without a transpose, and expert
parallel only has to shard dim 0. The module never routes: it receives tokens already sorted by
expert plus how many rows each expert owns, which is the interface expert parallel hooks into
(dispatch before `forward`, combine after).

Under torch.compile the experts stay inside the graph in every dtype: fp32 goes through the custom
op `plait::grouped_mm` (grouped_mm_op.py: torch's kernel with a fake rule for any dtype), bf16
through `torch._grouped_mm`, whose own fake rule admits it. When the groups are equal by
construction (capacity-mode expert parallel passes `group_rows`), CPU runs them as one batched
matmul instead of grouped_mm's loop over experts (as fast or faster, measured in bf16 and fp32).
"""

import torch
import torch.nn.functional as F
from torch import nn

from plait.models import cpu_bf16
from plait.models.cpu_bf16 import bmm, compute_dtype, cpu_multiplies_in_fp32

from .grouped_mm_op import grouped_mm as _grouped_mm_any_dtype
from .kernels import GROUP_ALIGNMENT, permute_and_pad, unpermute


def _local(w: torch.Tensor) -> torch.Tensor:
    # Expert parallel shards the weights as DTensors; token counts are data-dependent, which a
    # DTensor cannot express, so compute on the local shard. Duck-typed because a model must not
    # import torch.distributed.
    # (The class is asked, not the instance: under torch.compile the instance check on an FSDP
    # parameter answered False and grouped_mm received the DTensor.)
    return w.to_local() if hasattr(type(w), "to_local") else w


def _grouped_mm_ok(x: torch.Tensor, w1: torch.Tensor) -> bool:
    # torch._grouped_mm needs every row stride to be a multiple of 16 bytes.
    itemsize = x.element_size()
    return (x.shape[-1] * itemsize) % 16 == 0 and (w1.shape[-1] * itemsize) % 16 == 0


def _cuda_fast_grouped_mm(a: torch.Tensor) -> bool:
    # torch's CUDA `_grouped_mm` runs its CUTLASS kernel only for bf16 on compute capability 9.x /
    # 10.x (`_scaled_mm_allowed_device(sm90_only, sm100_only)`, major == 9 or 10, in
    # cuda/GroupedBlas.cpp); anything else takes `_grouped_mm_fallback`, which reads `offs` on the
    # host (`offs.cpu()`): a sync on every call.
    major, _ = torch.cuda.get_device_capability(a.device)
    return a.dtype == torch.bfloat16 and major in (9, 10)


@torch.compiler.disable
def _grouped_mm_sync_free(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    try:
        from .triton_grouped_mm import triton_grouped_mm
    except ImportError:  # no triton: torch's fallback (correct, one host sync per call)
        return torch._grouped_mm(a, b, offs=offs)
    return triton_grouped_mm(a.contiguous(), b, offs)


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    if a.is_cuda and not _cuda_fast_grouped_mm(a):
        # CUDA-only branch: fp32 (or bf16 below Hopper) through the Triton kernels, no host sync.
        return _grouped_mm_sync_free(a, b, offs)
    if (a.dtype != torch.bfloat16 and torch.compiler.is_compiling()) or cpu_multiplies_in_fp32(a.dtype, a.device):
        # torch's fake-tensor rule for grouped_mm admits bf16 only (the CUDA kernel's); the CPU
        # kernel also runs fp32, and the custom op lets the graph hold it (eager keeps torch's op).
        # bf16 on a CPU that emulates it goes through the op too: it multiplies in fp32 there.
        return _grouped_mm_any_dtype(a, b, offs)
    return torch._grouped_mm(a, b, offs=offs)


def run_experts_for_loop(
    w1_EDH: torch.Tensor,
    w2_EHD: torch.Tensor,
    w3_EDH: torch.Tensor,
    x_TD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
) -> torch.Tensor:
    """Reference: one matmul chain per expert. `.tolist()` syncs device to host; readable, slow."""
    counts = num_tokens_per_expert_E.tolist()
    used = sum(counts)
    y_chunks = []
    for e, x_chunk in enumerate(torch.split(x_TD[:used], counts, dim=0)):
        h = F.silu(x_chunk @ w1_EDH[e]) * (x_chunk @ w3_EDH[e])
        y_chunks.append(h @ w2_EHD[e])
    # Rows past the last group (padding of a static buffer) are defined as zero.
    y_chunks.append(x_TD.new_zeros(x_TD.shape[0] - used, w2_EHD.shape[-1]))
    return torch.cat(y_chunks, dim=0)


def run_experts_grouped_mm(
    w1_EDH: torch.Tensor,
    w2_EHD: torch.Tensor,
    w3_EDH: torch.Tensor,
    x_TD: torch.Tensor,
    num_tokens_per_expert_E: torch.Tensor,
    gemm=_grouped_mm,
) -> torch.Tensor:
    """Three grouped GEMMs over contiguous per-expert row blocks; no device-to-host sync. `gemm`:
    `(x_MK, w_GKN, offs_G) -> y_MN`, the dtype's own route unless the experts carry a replacement."""
    # grouped_mm takes int32 cumulative end rows, one per expert.
    offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    # grouped_mm leaves rows past the last offset uninitialised in its output and in the input
    # gradient (they can hold inf/NaN). Masking both ends zeroes them without a sync and keeps them
    # out of autograd, matching the loop path. (masked_fill with a number: one kernel; `where`
    # with a number first makes that number a tensor on the device, a second launch.)
    row_T = torch.arange(x_TD.shape[0], device=x_TD.device)
    padding_T1 = (row_T >= offsets_E[-1])[:, None]
    dtype = compute_dtype(x_TD)  # autocast has no rule for grouped_mm: cast as it casts a matmul
    x_TD = x_TD.masked_fill(padding_T1, 0.0).to(dtype)
    w1, w2, w3 = w1_EDH.to(dtype), w2_EHD.to(dtype), w3_EDH.to(dtype)
    h_TH = F.silu(gemm(x_TD, w1, offsets_E))
    h_TH = h_TH * gemm(x_TD, w3, offsets_E)
    y_TD = gemm(h_TH, w2, offsets_E)
    return y_TD.masked_fill(padding_T1, 0.0)


def _equal_groups_as_bmm(x: torch.Tensor) -> bool:
    # Measured on CPU (fwd + bwd, one thread, 4-8 experts of 16-256 rows, D 256-1024): bmm matches
    # grouped_mm's per-expert loop at large groups and is up to 1.7x faster at small ones, fp32 and
    # bf16. CUDA keeps grouped_mm (its grouped kernel; bmm there is unmeasured), and so does a traced
    # GPU step (cpu_bf16.gpu_route).
    return x.device.type != "cuda" and not cpu_bf16.GPU_ROUTE


def run_experts_bmm(
    w1_EDH: torch.Tensor, w2_EHD: torch.Tensor, w3_EDH: torch.Tensor, x_TD: torch.Tensor, group_rows: int
) -> torch.Tensor:
    """Every expert owns exactly `group_rows` consecutive rows: one batched matmul per weight."""
    E, D = w1_EDH.shape[0], x_TD.shape[-1]
    torch._check(x_TD.shape[0] == E * group_rows, lambda: f"equal groups: {E} x {group_rows} rows expected")
    dtype = compute_dtype(x_TD)  # the grouped path's casts, so both give the same dtypes
    x_EGD = x_TD.view(E, group_rows, D).to(dtype)
    w1_EDH, w2_EHD, w3_EDH = w1_EDH.to(dtype), w2_EHD.to(dtype), w3_EDH.to(dtype)
    # No mask needed: every row belongs to a group (capacity padding rows are zeros in and out).
    h_EGH = F.silu(bmm(x_EGD, w1_EDH)) * bmm(x_EGD, w3_EDH)
    return bmm(h_EGH, w2_EHD).view(E * group_rows, -1)


class GroupedExperts(nn.Module):
    """`num_experts` SwiGLU experts: `y = (silu(x @ w1[e]) * (x @ w3[e])) @ w2[e]`.

    `forward(x_TD, num_tokens_per_expert_E)`: rows of `x_TD` are sorted by expert, expert `e`
    owning the next `num_tokens_per_expert_E[e]` rows. Counts may include padding rows (the
    permute kernel's aligned layout: pass its `m_sizes`); rows past `sum(counts)` produce zeros.
    `E` is whatever dim 0 of the (possibly expert-parallel-sharded) weights holds locally.

    `group_rows` (keyword, optional): the caller guarantees that every local expert owns exactly
    `group_rows` rows and `x_TD` has `E * group_rows` of them, known when the graph is built (not
    read from the counts). Capacity-mode expert parallel passes it (docs/contracts.md); the CPU then
    runs one batched matmul per weight instead of a loop over experts.
    """

    def __init__(self, dim: int, hidden_dim: int, num_experts: int, use_grouped_mm: bool = True):
        super().__init__()
        self.num_experts = num_experts
        self.use_grouped_mm = use_grouped_mm
        self.w1 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))
        self.w3 = nn.Parameter(torch.empty(num_experts, dim, hidden_dim))

    # Expert parallel's reorder of received tokens (source rank, local expert) -> expert-major and
    # back, part of the experts contract (docs/contracts.md): Triton on CUDA, torch elsewhere.
    permute_and_pad = staticmethod(permute_and_pad)
    unpermute = staticmethod(unpermute)
    # Rows each group must start at a multiple of, for the grouped GEMM (kernels.GROUP_ALIGNMENT:
    # the rule and where it comes from). Expert parallel's dispatchers read it and pad while they
    # reorder, then set `pad_groups = False`; without them (ep = 1) forward pads the groups itself.
    group_alignment = GROUP_ALIGNMENT
    pad_groups = True
    # A replacement grouped GEMM, `(x_MK, w_GKN, offs_G) -> y_MN` on rows padded to
    # `group_alignment` (float8 training installs torchao's scaled grouped GEMM and raises the
    # alignment to what its kernel needs), or None: the dtype's own route. The model stays as
    # written; what replaces the GEMM is the trainer's choice, made before any parallelism.
    grouped_mm = None

    def forward(
        self, x_TD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor, group_rows: int | None = None
    ) -> torch.Tensor:
        w1, w2, w3 = _local(self.w1), _local(self.w2), _local(self.w3)
        gemm = self.grouped_mm or _grouped_mm
        if self.grouped_mm is None:
            if group_rows is not None and _equal_groups_as_bmm(x_TD):
                return run_experts_bmm(w1, w2, w3, x_TD, group_rows)
            if not (self.use_grouped_mm and _grouped_mm_ok(x_TD, w1)):
                return run_experts_for_loop(w1, w2, w3, x_TD, num_tokens_per_expert_E)
        if not self.pad_groups or self.group_alignment == 1:
            return run_experts_grouped_mm(w1, w2, w3, x_TD, num_tokens_per_expert_E, gemm)
        # ep = 1: pad every group to the alignment (one expert-major "source rank"), run, restore.
        N = x_TD.shape[0]
        x_padded_PD, permuted_P, m_sizes_E = permute_and_pad(
            x_TD, num_tokens_per_expert_E, 1, w1.shape[0], self.group_alignment
        )
        y_padded_PD = run_experts_grouped_mm(w1, w2, w3, x_padded_PD, m_sizes_E, gemm)
        y_ND = unpermute(y_padded_PD, permuted_P, N)
        # Rows past the groups (a static buffer's tail) were never mapped: zero, like the loop's.
        padding_N1 = (torch.arange(N, device=x_TD.device) >= num_tokens_per_expert_E.sum())[:, None]
        return y_ND.masked_fill(padding_N1, 0.0)

    def init_weights(self, init_std: float) -> None:
        nn.init.trunc_normal_(self.w1, mean=0.0, std=0.02)
        nn.init.trunc_normal_(self.w2, mean=0.0, std=init_std)
        nn.init.trunc_normal_(self.w3, mean=0.0, std=init_std)
