"""`plait::document_attention`: block-diagonal causal attention over packed documents, one op per layer.

    document_attention(q [T, H, A], k [T, G, A], v [T, G, Av], cu_seqlens [N + 1], max_seqlen, scale)
        -> out [T, H, Av]

The tokens of every row are folded into T = B x S; `cu_seqlens` (int32, on q's device) holds each
document's first token in that fold and then T, padded at the end with T (empty documents), so
its shape stays the same from step to step (plait.models.documents.document_offsets); every
document is at most `max_seqlen` tokens. A query sees the earlier keys of its own document.

One op for the model on every device, so a compiled block traces it as one node (a fake kernel
gives the shapes) and a step dispatches one attention op per layer, however many documents a row
holds. Its kernels:
- CUDA, fp16 / bf16, head dim a multiple of 8 and at most 256 ("varlen"): one FlashAttention-2
  variable-length call forward (aten._flash_attention_forward with cum_seq_q / cum_seq_k) and one
  backward. Queries and keys share the offsets, so every document is a square block, where FA2's
  bottom-right causal mask is the top-left one. Grouped-query attention goes in as it is.
- anything else ("segments": the CPU, CUDA fp32): one causal flash call per document, read from
  `cu_seqlens` on the host. On the CPU that read is free; on CUDA it is a host sync, the price of
  the fp32 fallback.
MLA's narrower values (Av < A) are zero-padded to A for the flash kernels, the padding's output
columns sliced off. The log-sum-exp ([H, T], fp32) is an output for the backward only: it is
never differentiated (torch's own varlen_attn drops its gradient).
"""

import functools
import inspect
import math

import torch
import torch.nn.functional as F

from plait.models.cpu_bf16 import compute_dtype, cpu_attends_in_fp32

_HALF = (torch.float16, torch.bfloat16)
VARLEN_MAX_HEAD_DIM = 256


def kernel_route(q: torch.Tensor, head_dim: int | None = None) -> str:
    """"varlen" where one FlashAttention-2 call serves every document, else "segments". The step
    sentinel (plait.testing.sentinel) checks every call's inputs against varlen's preconditions on
    CPU runs too."""
    head_dim = q.shape[-1] if head_dim is None else head_dim
    ok = q.device.type == "cuda" and q.dtype in _HALF and head_dim % 8 == 0 and head_dim <= VARLEN_MAX_HEAD_DIM
    return "varlen" if ok else "segments"


# ---- the varlen (CUDA) kernel ------------------------------------------------------------------


@functools.cache
def _schema_names(op) -> frozenset[str]:
    """The op's argument names, read once (the schema never changes; each call is host work)."""
    return frozenset(a.name for a in op.default._schema.arguments)


def flash_window_kwargs(argument_names) -> dict:
    """Causal as FA2 states it, for the schema at hand: torch versions whose
    `_flash_attention_forward` takes window sizes get (-1, 0) (what `is_causal` sets inside FA2
    anyway: unbounded left, nothing right); older schemas only `is_causal`."""
    names = set(argument_names)
    if {"window_size_left", "window_size_right"} <= names:
        return {"window_size_left": -1, "window_size_right": 0}
    return {}


def flash_signature() -> str:
    """One line naming what this torch offers: the aten varlen ops' window arguments and
    torch.nn.attention.varlen.varlen_attn's causal argument (the GPU lease prints it)."""
    parts = [f"torch {torch.__version__}"]
    for name in ("_flash_attention_forward", "_flash_attention_backward"):
        op = getattr(torch.ops.aten, name, None)
        if op is None:
            parts.append(f"aten.{name}: missing")
            continue
        window = "window_size_left/right" if flash_window_kwargs(_schema_names(op)) else "is_causal only"
        parts.append(f"aten.{name}: {window}")
    try:
        from torch.nn.attention.varlen import varlen_attn

        params = inspect.signature(varlen_attn).parameters
        causal = "window_size" if "window_size" in params else "is_causal" if "is_causal" in params else "?"
        parts.append(f"varlen_attn causal via {causal}")
    except ImportError:
        parts.append("no torch.nn.attention.varlen")
    return "; ".join(parts)


def _varlen_forward(q, k, v, cu_seqlens, max_seqlen: int, scale: float):
    op = torch.ops.aten._flash_attention_forward
    out, lse, *_ = op(
        q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False,
        scale=scale, **flash_window_kwargs(_schema_names(op)),
    )  # fmt: skip
    return out, lse


def _varlen_backward(dout, q, k, v, out, lse, cu_seqlens, max_seqlen: int, scale: float):
    op = torch.ops.aten._flash_attention_backward
    # No dropout: the rng state (2.13) / philox seed and offset (older) are never read.
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    return op(
        dout, q, k, v, out, lse, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, unused, unused,
        scale=scale, **flash_window_kwargs(_schema_names(op)),
    )  # fmt: skip


# ---- the per-document ("segments") kernel -----------------------------------------------------


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """The non-empty documents' [start, end) (the padding's empty ones dropped)."""
    ends = cu_seqlens.tolist()
    return [(s, e) for s, e in zip(ends, ends[1:]) if e > s]


def _heads_first(x_LHA: torch.Tensor) -> torch.Tensor:
    return x_LHA.transpose(0, 1).unsqueeze(0)  # [1, H, L, A]: a view, the layout SDPA is given


def _cpu_fp32(q: torch.Tensor) -> bool:
    return q.dtype in _HALF and cpu_attends_in_fp32(q.shape[-1])


def _segments_forward(q, k, v, cu_seqlens, scale: float):
    dv, head_dim = v.shape[-1], q.shape[-1]
    v = _pad_last(v, head_dim)
    outs, lses = [], []
    in_fp32 = q.device.type == "cpu" and _cpu_fp32(q)
    for s, e in _bounds(cu_seqlens):
        qs, ks, vs = (_heads_first(t[s:e]) for t in (q, k, v))
        if in_fp32:
            qs, ks, vs = qs.float(), ks.float(), vs.float()
        if q.device.type == "cpu":
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(qs, ks, vs, 0.0, True, scale=scale)
        else:
            out, lse = _math_forward(qs, ks, vs, scale)
        outs.append(out[0].transpose(0, 1))  # [L, H, A]
        lses.append(lse[0])  # [H, L]
    out_THA = torch.cat(outs, 0)[..., :dv].to(q.dtype)
    return out_THA, torch.cat(lses, 1).float().contiguous()


def _segments_backward(dout, q, k, v, out, lse, cu_seqlens, scale: float):
    dv_dim, head_dim = v.shape[-1], q.shape[-1]
    v, out, dout = _pad_last(v, head_dim), _pad_last(out, head_dim), _pad_last(dout, head_dim)
    in_fp32 = q.device.type == "cpu" and _cpu_fp32(q)
    dqs, dks, dvs = [], [], []
    for s, e in _bounds(cu_seqlens):
        ds, qs, ks, vs, os_ = (_heads_first(t[s:e]) for t in (dout, q, k, v, out))
        if in_fp32:
            ds, qs, ks, vs, os_ = ds.float(), qs.float(), ks.float(), vs.float(), os_.float()
        lse_s = lse[:, s:e].unsqueeze(0).contiguous()  # the kernels read it as a dense [1, H, L]
        if q.device.type == "cpu":
            grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
                ds, qs, ks, vs, os_, lse_s, 0.0, True, scale=scale
            )
        else:
            grads = _math_backward(ds, qs, ks, vs, os_, lse_s, scale)
        for acc, g in zip((dqs, dks, dvs), grads):
            acc.append(g[0].transpose(0, 1))
    dq = torch.cat(dqs, 0).to(q.dtype)
    dk = torch.cat(dks, 0).to(k.dtype)
    dv = torch.cat(dvs, 0)[..., :dv_dim].to(v.dtype)
    return dq, dk, dv


def _pad_last(x: torch.Tensor, size: int) -> torch.Tensor:
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))


def _grouped(x_1HLA: torch.Tensor, groups: int) -> torch.Tensor:
    _, H, L, A = x_1HLA.shape
    return x_1HLA.reshape(groups, H // groups, L, A)


def _math_forward(q, k, v, scale: float):
    """fp32 causal attention of one document [1, H, L, A] with its lse (the non-flash fallback)."""
    G = k.shape[1]
    scores = torch.einsum("grqa,gka->grqk", _grouped(q, G).float(), k[0].float()) * scale
    L = q.shape[2]
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    out = torch.einsum("grqk,gka->grqa", torch.exp(scores - lse[..., None]), v[0].float())
    return out.reshape(1, -1, L, v.shape[-1]).to(q.dtype), lse.reshape(1, -1, L)


def _math_backward(dout, q, k, v, out, lse, scale: float):
    G, L = k.shape[1], q.shape[2]
    qg, dg, og = (_grouped(t, G).float() for t in (q, dout, out))
    scores = torch.einsum("grqa,gka->grqk", qg, k[0].float()) * scale
    scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool, device=q.device).tril(), float("-inf"))
    probs = torch.exp(scores - lse.reshape(G, -1, L)[..., None])
    dv = torch.einsum("grqk,grqa->gka", probs, dg)
    dprobs = torch.einsum("grqa,gka->grqk", dg, v[0].float())
    dscores = probs * (dprobs - (dg * og).sum(-1, keepdim=True)) * scale
    dq = torch.einsum("grqk,gka->grqa", dscores, k[0].float()).reshape(1, -1, L, q.shape[-1])
    dk = torch.einsum("grqk,grqa->gka", dscores, qg)
    return dq.to(q.dtype), dk[None].to(k.dtype), dv[None].to(v.dtype)


# ---- the op -----------------------------------------------------------------------------------


@torch.library.custom_op("plait::document_attention", mutates_args=())
def _document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.autocast(q.device.type, enabled=False):
        if kernel_route(q) == "varlen":
            out, lse = _varlen_forward(q, k, _pad_last(v, q.shape[-1]), cu_seqlens, max_seqlen, scale)
            return out[..., : v.shape[-1]].contiguous(), lse
        return _segments_forward(q, k, v, cu_seqlens, scale)


@_document_attention.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, scale):
    T, H, _ = q.shape
    return q.new_empty(T, H, v.shape[-1]), q.new_empty(H, T, dtype=torch.float32)


@torch.library.custom_op("plait::document_attention_backward", mutates_args=())
def _document_attention_backward(
    dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
    cu_seqlens: torch.Tensor, max_seqlen: int, scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    with torch.autocast(q.device.type, enabled=False):
        if kernel_route(q) == "varlen":
            head_dim, dv_dim = q.shape[-1], v.shape[-1]
            dq, dk, dv = _varlen_backward(
                _pad_last(dout.contiguous(), head_dim), q, k, _pad_last(v, head_dim), _pad_last(out, head_dim),
                lse, cu_seqlens, max_seqlen, scale,
            )  # fmt: skip
            return dq, dk, dv[..., :dv_dim].contiguous()
        return _segments_backward(dout, q, k, v, out, lse, cu_seqlens, scale)


@_document_attention_backward.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_seqlens, max_seqlen, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
    ctx.max_seqlen, ctx.scale = max_seqlen, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens = ctx.saved_tensors
    dq, dk, dv = _document_attention_backward(dout, q, k, v, out, lse, cu_seqlens, ctx.max_seqlen, ctx.scale)
    return dq, dk, dv, None, None, None


_document_attention.register_autograd(_backward, setup_context=_setup_context)


def _document_pairs(cu_seqlens) -> int | None:
    """Query-key pairs the documents compute (causal per document: L (L + 1) / 2 each), read from
    the offsets when they are real host values; None for fake or device tensors (no read)."""
    if isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.device.type == "cpu" and not _is_fake(cu_seqlens):
        ends = cu_seqlens.tolist()
        return sum((e - s) * (e - s + 1) // 2 for s, e in zip(ends, ends[1:]))
    return None


def _is_fake(t: torch.Tensor) -> bool:
    return type(t).__name__ in ("FakeTensor", "FunctionalTensor") or t.device.type == "meta"


def document_attention_flops(q, v, cu_seqlens, max_seqlen: int, backward: bool = False) -> int:
    """FLOPs of one call: per computed query-key pair and head, 2 FLOPs for each of q.k (head dim A)
    and p.v (Av); the backward 2.5x the forward (its five matmuls against two). Without host
    offsets (a fake trace), causal rows of `max_seqlen` bound the pairs."""
    T, H, A = q.shape
    pairs = _document_pairs(cu_seqlens)
    if pairs is None:
        pairs = T * (max_seqlen + 1) // 2
    forward = pairs * H * (2 * A + 2 * v.shape[-1])
    return forward * 5 // 2 if backward else forward


def _register_flop_formulas() -> None:
    from torch.utils.flop_counter import register_flop_formula

    @register_flop_formula(torch.ops.plait.document_attention, get_raw=True)
    def _forward_flops(q, k, v, cu_seqlens, max_seqlen, scale, *args, out_val=None, **kwargs) -> int:
        return document_attention_flops(q, v, cu_seqlens, max_seqlen)

    @register_flop_formula(torch.ops.plait.document_attention_backward, get_raw=True)
    def _backward_flops(dout, q, k, v, out, lse, cu_seqlens, max_seqlen, scale, *args, out_val=None, **kwargs) -> int:
        return document_attention_flops(q, v, cu_seqlens, max_seqlen, backward=True)


_register_flop_formulas()


def document_attention(
    q_THA: torch.Tensor, k_TGA: torch.Tensor, v_TGA: torch.Tensor, cu_seqlens: torch.Tensor, max_seqlen: int,
    scale: float | None = None,
) -> torch.Tensor:  # fmt: skip
    """Causal attention within each document of the folded tokens (see the module docstring):
    one `plait::document_attention` call, differentiable in q, k and v. Under autocast the inputs
    go in the autocast dtype, as they would to SDPA."""
    dtype = compute_dtype(q_THA)
    q_THA, k_TGA, v_TGA = (t.to(dtype) for t in (q_THA, k_TGA, v_TGA))
    scale = 1.0 / math.sqrt(q_THA.shape[-1]) if scale is None else float(scale)
    out_THA, _ = torch.ops.plait.document_attention(q_THA, k_TGA, v_TGA, cu_seqlens, int(max_seqlen), scale)
    return out_THA


def segment_loop_attention(
    q_THA: torch.Tensor, k_TGA: torch.Tensor, v_TGA: torch.Tensor, bounds, scale: float | None = None
) -> torch.Tensor:
    """The reference: one causal SDPA call per document [bounds[i], bounds[i + 1]) of the folded
    tokens, differentiable through SDPA's own autograd (what document attention was before the op;
    benchmarks/bench_varlen.py times the two against each other)."""
    gqa = q_THA.shape[1] != k_TGA.shape[1]
    dv, head_dim = v_TGA.shape[-1], q_THA.shape[-1]
    outs = []
    for s, e in zip(bounds, bounds[1:]):
        if e <= s:
            continue
        q, k, v = (_heads_first(t[s:e]) for t in (q_THA, k_TGA, _pad_last(v_TGA, head_dim)))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
        outs.append(out[0].transpose(0, 1)[..., :dv])
    return torch.cat(outs, 0)
