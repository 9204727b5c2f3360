"""Attention kernels that return the log-sum-exp, and the exact merge of blocks through it.

    attention_forward(q, k, v, causal, scale)                 -> out [B, H, Lq, Dv], lse [B, H, Lq] fp32
    attention_backward(dout, q, k, v, out, lse, causal, scale) -> dq, dk, dv

q is [B, H, Lq, Dqk], k [B, G, Lk, Dqk], v [B, G, Lk, Dv] with H a multiple of G (grouped-query
attention goes to the kernels without copying K/V). `causal` is only ever used on square blocks:
the kernels align the mask top-left, which is the diagonal only when Lq == Lk.

The backward of one block takes the *merged* output and log-sum-exp of all blocks: softmax
probabilities rebuilt from the global lse are the global ones, so each block's dq/dk/dv are its
exact share of the full gradient (the ring-flash-attention identity).

Kernels: CPU -> aten._scaled_dot_product_flash_attention_for_cpu (any float dtype, native GQA);
CUDA fp16/bf16 with head dim a multiple of 8, <= 256 -> aten._scaled_dot_product_flash_attention
(FlashAttention-2, native GQA); anything else -> an explicit fp32 implementation (`math_forward` /
`math_backward`). The flash kernels need Dv == Dqk, so MLA's narrower values are zero-padded and the
padding sliced off. Callers hand every kernel what the CUDA one needs, on CPU too
(`flash_input_problems` says what that is; the tests check every call against it).

On CPU, fp16/bf16 blocks run the flash kernel in fp32 when the caller says so (CPU_HALF_IN_FP32:
the models' rule, plait.models.cpu_bf16, passed down by the trainer: where that is faster, e.g. a
CPU that does not multiply bf16 natively, 2.3-2.6x). The results come back in the input dtype; the
log-sum-exp is fp32 either way.
"""

import contextlib
import functools

import torch
import torch.nn.functional as F

_HALF = (torch.float16, torch.bfloat16)
# Whether half-precision blocks run the CPU flash kernel in fp32: the caller's decision, made once
# where the models make theirs (plait.models.cpu_bf16: the trainer passes it as
# ContextParallelConfig.cpu_half_in_fp32, which apply_context_parallel sets here). Context parallel
# probes nothing itself; left False, it runs torch's kernels in the blocks' dtype.
CPU_HALF_IN_FP32 = False
# True only inside `gpu_route()`: a planner tracing a GPU's step on the CPU device (fake tensors),
# where blocks keep their dtype as the CUDA kernels do (plait.models.cpu_bf16.gpu_route, the same rule).
GPU_ROUTE = False


@contextlib.contextmanager
def gpu_route():
    """Within: half-precision blocks are not run in fp32 on the CPU (what a GPU computes)."""
    global GPU_ROUTE
    before, GPU_ROUTE = GPU_ROUTE, True
    try:
        yield
    finally:
        GPU_ROUTE = before


def _cpu_in_fp32(q: torch.Tensor) -> bool:
    return not GPU_ROUTE and q.dtype in _HALF and CPU_HALF_IN_FP32


def _kernel(q: torch.Tensor) -> str:
    if q.device.type == "cpu":
        return "cpu_flash"
    # FlashAttention-2's backward (flash_api.cpp mha_bwd) takes fp16/bf16 with a head dim that is a
    # multiple of 8 and at most 256 (F.scaled_dot_product_attention pads it; these ops do not).
    if q.device.type == "cuda" and q.dtype in _HALF and q.shape[-1] <= 256 and q.shape[-1] % 8 == 0:
        return "cuda_flash"
    return "math"


def flash_input_problems(q, k, v, out=None, dout=None, lse=None) -> list[str]:
    """What breaks the CUDA flash kernels' preconditions among these inputs ([] when none).

    Checked on CPU too, so the one code path hands the CPU kernels what the CUDA ones need.
    FlashAttention-2 (torch's flash_api.cpp) checks only stride(-1) == 1 of q, k, v, out and dout,
    and reads the log-sum-exp through a bare pointer as a dense [B, H, Lq]: a strided slice of it
    gives silently wrong gradients. It loads rows with 16-byte vector loads (aligned pointers).
    K and V must be dense along (sequence, head dim) -- slices of a contiguous tensor along the
    sequence, never columns of a [K | V] buffer -- as torch's own ring attention passes them.
    """
    problems = []
    named = {"q": q, "k": k, "v": v, "out": out, "dout": dout}
    for name, t in named.items():
        if t is None:
            continue
        if t.stride(-1) != 1:
            problems.append(f"{name}: stride(-1) = {t.stride(-1)}, needs 1")
        if t.data_ptr() % 16:
            problems.append(f"{name}: data pointer not 16-byte aligned")
        if t.dtype != q.dtype:
            problems.append(f"{name}: dtype {t.dtype}, q has {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.shape[-2] > 1 and t.stride(-2) != t.shape[-1]:
            problems.append(f"{name}: row stride {t.stride(-2)} != head dim {t.shape[-1]} (interleaved with another tensor)")
    if lse is not None:
        if not lse.is_contiguous():
            problems.append(f"lse: not contiguous (strides {lse.stride()} for shape {tuple(lse.shape)})")
        if lse.dtype != accum_dtype(q.dtype):
            problems.append(f"lse: dtype {lse.dtype}, needs {accum_dtype(q.dtype)}")
    return problems


def attention_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    kernel = _kernel(q)
    if kernel == "math":
        return math_forward(q, k, v, causal, scale)
    dv = v.shape[-1]
    v = _pad_last(v, q.shape[-1])
    if kernel == "cpu_flash" and _cpu_in_fp32(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q.float(), k.float(), v.float(), 0.0, causal, scale=scale
        )
        out = out.to(q.dtype)
    elif kernel == "cpu_flash":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    else:
        out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    # The CPU kernel returns the lse as a transposed view, CUDA's is dense: callers may hand it
    # straight back to the backward (Ulysses does), which needs it dense. Free on CUDA.
    return out[..., :dv], lse.contiguous()


def attention_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    kernel = _kernel(q)
    if kernel == "math":
        return math_backward(dout, q, k, v, out, lse, causal, scale)
    dv_dim, d = v.shape[-1], q.shape[-1]
    v, out, dout = _pad_last(v, d), _pad_last(out, d), _pad_last(dout, d)
    if kernel == "cpu_flash" and _cpu_in_fp32(q):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.float(), q.float(), k.float(), v.float(), out.float(), lse, 0.0, causal, scale=scale
        )
        dq, dk, dv = (g.to(q.dtype) for g in grads)
    elif kernel == "cpu_flash":
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale
        )
    else:
        empty = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, empty, empty, scale=scale
        )
    return dq, dk, dv[..., :dv_dim]


# ---- document calls: every causal square of a plan in one call ------------------------------


def _varlen(q: torch.Tensor) -> bool:
    return _kernel(q) == "cuda_flash"


@functools.cache
def _flash_window(op) -> dict:
    """Causal as this torch's schema states it: window (-1, 0) where `_flash_attention_forward`
    takes window sizes (torch 2.13), `is_causal` alone where it does not (decided by the schema's
    argument names, not the version)."""
    names = {a.name for a in op.default._schema.arguments}
    return {"window_size_left": -1, "window_size_right": 0} if "window_size_left" in names else {}


def documents_forward(q_THA, k_TGA, v_TGA, bounds, cu_seqlens, max_len: int, scale: float):
    """Causal attention within each document of the folded tokens: q [T, H, A], k [T, G, A],
    v [T, G, Av]; `bounds` the documents' offsets on the host (0, ..., T), `cu_seqlens` the same
    on q's device (int32). -> out [T, H, Av], lse [H, T] (fp32).

    CUDA fp16 / bf16 (FlashAttention-2's head dims): one varlen call for every document, square by
    construction (queries and keys share the offsets, so FA2's bottom-right causal mask is the
    top-left one); elsewhere one flash call per document."""
    dv = v_TGA.shape[-1]
    if _varlen(q_THA):
        op = torch.ops.aten._flash_attention_forward
        out, lse, *_ = op(
            q_THA, k_TGA, _pad_last(v_TGA, q_THA.shape[-1]), cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True,
            False, scale=scale, **_flash_window(op),
        )  # fmt: skip
        return out[..., :dv], lse
    outs, lses = [], []
    for s, e in zip(bounds, bounds[1:]):
        q, k, v = _one_document(q_THA, s, e), _one_document(k_TGA, s, e, dense=True), _one_document(v_TGA, s, e, dense=True)
        out, lse = attention_forward(q, k, v, True, scale)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def documents_backward(dout_THA, q_THA, k_TGA, v_TGA, out_THA, lse_HT, bounds, cu_seqlens, max_len: int, scale: float):
    """The backward of `documents_forward` given the MERGED output and lse (of every block the
    queries attended, not only these documents): each document's exact share of dq, dk, dv."""
    if _varlen(q_THA):
        d, dv = q_THA.shape[-1], v_TGA.shape[-1]
        op = torch.ops.aten._flash_attention_backward
        unused = torch.empty(0, dtype=torch.int64, device=q_THA.device)  # no dropout: never read
        dq, dk, dv_ = op(
            _pad_last(dout_THA, d).contiguous(), q_THA, k_TGA, _pad_last(v_TGA, d), _pad_last(out_THA, d).contiguous(),
            lse_HT.contiguous(), cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, unused, unused,
            scale=scale, **_flash_window(op),
        )  # fmt: skip
        return dq, dk, dv_[..., :dv]
    grads = ([], [], [])
    for s, e in zip(bounds, bounds[1:]):
        pieces = (_one_document(t, s, e, dense=t is k_TGA or t is v_TGA) for t in (dout_THA, q_THA, k_TGA, v_TGA, out_THA))
        lse = lse_HT[:, s:e].unsqueeze(0).contiguous()
        for acc, g in zip(grads, attention_backward(*pieces, lse, True, scale)):
            acc.append(g[0].transpose(0, 1))
    return tuple(torch.cat(g) for g in grads)


def _one_document(x_THA: torch.Tensor, start: int, end: int, dense: bool = False) -> torch.Tensor:
    """One document as [1, H, L, A]: a view for q, out, dout (stride(-1) == 1 is all the kernels need
    of them), a dense copy for k and v (rows of one head adjacent, as the flash kernels read them)."""
    x = x_THA[start:end].transpose(0, 1).unsqueeze(0)
    return x.contiguous() if dense else aligned(x)


def accum_dtype(dtype: torch.dtype) -> torch.dtype:
    """Outputs, log-sum-exps and gradients accumulate in fp32 (fp64 inputs stay fp64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its last dim has stride 1 (the models' transposed q is), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def aligned(x: torch.Tensor) -> torch.Tensor:
    """`x` itself when its data pointer is 16-byte aligned (FlashAttention-2's vector loads), else a
    dense copy. Slices at token offsets (document plans) are aligned whenever a token's row of the
    head dim is a multiple of 16 bytes, as every head dim the CUDA flash kernel takes is in fp16/bf16."""
    return x if x.data_ptr() % 16 == 0 else torch.empty_like(x, memory_format=torch.contiguous_format).copy_(x)


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _grouped(q: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, H, L, D] -> [B, G, H/G, L, D]: query heads grouped under the kv head they share."""
    B, H, L, D = q.shape
    return q.view(B, n_kv, H // n_kv, L, D)


def _causal_mask(lq: int, lk: int, device) -> torch.Tensor:
    return torch.ones(lq, lk, dtype=torch.bool, device=device).tril()


def math_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Explicit fp32 attention with the log-sum-exp: the reference, and the fallback kernel."""
    G, acc = k.shape[1], accum_dtype(q.dtype)
    scores = torch.einsum("bgrqd,bgkd->bgrqk", _grouped(q, G).to(acc), k.to(acc)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    lse = scores.logsumexp(dim=-1)
    probs = torch.exp(scores - lse[..., None])
    out = torch.einsum("bgrqk,bgkd->bgrqd", probs, v.to(acc))
    return out.flatten(1, 2).to(q.dtype), lse.flatten(1, 2)


def math_backward(dout, q, k, v, out, lse, causal: bool, scale: float):
    G, acc = k.shape[1], accum_dtype(q.dtype)
    qg, dout_g, out_g = (_grouped(t, G).to(acc) for t in (q, dout, out))
    scores = torch.einsum("bgrqd,bgkd->bgrqk", qg, k.to(acc)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[2], k.shape[2], q.device), float("-inf"))
    probs = torch.exp(scores - _grouped(lse[..., None], G))
    dv = torch.einsum("bgrqk,bgrqd->bgkd", probs, dout_g)
    dprobs = torch.einsum("bgrqd,bgkd->bgrqk", dout_g, v.to(acc))
    delta = (dout_g * out_g).sum(-1, keepdim=True)
    dscores = probs * (dprobs - delta) * scale
    dq = torch.einsum("bgrqk,bgkd->bgrqd", dscores, k.to(acc)).flatten(1, 2)
    dk = torch.einsum("bgrqk,bgrqd->bgkd", dscores, qg)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class MergedAttention:
    """fp32 accumulator of blocks over the rows of a local query buffer, merged by their lse.

    out = sum_i exp(lse_i - lse) * out_i with lse = logsumexp_i(lse_i): exact, whatever the order.
    Every row must receive at least one block (causal attention always sees its own token).
    """

    def __init__(self, q: torch.Tensor, dv: int):
        B, H, L, _ = q.shape
        dtype = accum_dtype(q.dtype)
        self.out = torch.zeros(B, H, L, dv, dtype=dtype, device=q.device)
        self.lse = torch.full((B, H, L), float("-inf"), dtype=dtype, device=q.device)

    def add(self, rows: slice, out_blk: torch.Tensor, lse_blk: torch.Tensor, batch: slice = slice(None)) -> None:
        """Merge a block computed for query `rows` of batch rows `batch` (document plans cover some rows)."""
        lse_old = self.lse[batch, :, rows]
        lse_new = torch.logaddexp(lse_old, lse_blk)
        out = self.out[batch, :, rows]
        out.mul_(torch.exp(lse_old - lse_new)[..., None])
        out.add_(out_blk.to(out.dtype) * torch.exp(lse_blk - lse_new)[..., None])
        self.lse[batch, :, rows] = lse_new
