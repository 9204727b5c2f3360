"""Document masking on the device under test: the models' one op per layer
(`plait::document_attention`) and context parallel's document plans on the CUDA kernels, against
math attention per document, and a document-masked forward + backward without a host sync when the
segments and offsets were built on the host beforehand.

CUDA-only branches tested here:
- plait/models/document_attention.py `kernel_route` -> "varlen" (`_varlen_forward` /
  `_varlen_backward`: one FlashAttention-2 varlen call each, window (-1, 0) or is_causal by the
  schema): test_model_document_attention (bf16, GQA and MLA's padded values, padded offsets),
  test_varlen_is_one_flash_call_per_layer, test_compiled_document_block;
- the CUDA fp32 fallback (one math call per document): test_model_document_attention (fp32);
- the trainer's host-built offsets moved with the positions: test_document_step_does_not_sync...;
- plait/contextparallel/kernels.py `documents_forward` / `documents_backward` varlen branch (the
  causal squares of a CP document plan in one call, blockwise.Diagonal), all-gather, ring and
  Ulysses: test_context_parallel_documents_on_one_rank_group (bf16),
  test_context_parallel_diagonal_is_one_varlen_call.

Reference: per document, fp32 math SDPA, causal, on the same dtype-rounded inputs. Tolerances as in
test_gpu_contextparallel.py: fp32 1e-4, bf16 2e-2 of the reference's largest magnitude.
"""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from plait.contextparallel import ContextParallelAttention, SequenceLayout
from plait.models import llama3
from plait.models.common import ScaledDotProductAttention
from plait.models.document_attention import flash_signature, kernel_route
from plait.models.documents import offsets_of, row_segments, to_device_with_segments

SHAPES = {"gqa": (8, 2, 64, 64), "mla": (4, 4, 192, 128)}  # (H, G, Dqk, Dv)
# Row 0: a document tail (offset 5), a 1-token document, 16, 30, 12 tokens; row 1: one document.
LENGTHS, SEQ = (5, 1, 16, 30, 12), 64
DTYPES = [torch.float32, torch.bfloat16]


def _document_positions():
    pieces = [torch.arange(n) for n in LENGTHS]
    pieces[0] = pieces[0] + 5
    return torch.stack([torch.cat(pieces), torch.arange(SEQ)]).int()


def _inputs(device, dtype, shape):
    H, G, dqk, dv = SHAPES[shape]
    q, k, v, dout = (torch.randn(2, n, SEQ, d) for n, d in ((H, dqk), (G, dqk), (G, dv), (H, dv)))
    return [t.to(device, dtype) for t in (q, k, v, dout)]


def _reference(q, k, v, dout, scale):
    """Each document alone, fp32 math SDPA: out and the q, k, v gradients."""
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k_rep, v_rep = k32.repeat_interleave(rep, 1), v32.repeat_interleave(rep, 1)
    bounds = [(0, *torch.tensor(LENGTHS).cumsum(0).tolist()), (0, SEQ)]
    rows = []
    with sdpa_kernel(SDPBackend.MATH):
        for b, cuts in enumerate(bounds):
            rows.append(torch.cat([
                F.scaled_dot_product_attention(q32[b:b + 1, :, s:e], k_rep[b:b + 1, :, s:e], v_rep[b:b + 1, :, s:e],
                                               is_causal=True, scale=scale)
                for s, e in zip(cuts, cuts[1:])
            ], dim=2))  # fmt: skip
    out = torch.cat(rows)
    out.backward(dout.float())
    return out.detach(), q32.grad, k32.grad, v32.grad


def _check(got, want, dtype, what):
    scale = want.abs().max().item()
    tol = 1e-4 * max(scale, 1.0) if dtype == torch.float32 else 2e-2 * scale
    err = (got.float() - want).abs().max().item()
    assert err <= tol, f"{what}: max error {err:.3g} > {tol:.3g} (reference max {scale:.3g})"


def _run(attend, q, k, v, dout, dtype, what):
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = attend(*leaves)
    out.backward(dout)
    ref = _reference(q, k, v, dout, 0.1)
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref):
        assert g.dtype == dtype, f"{what} {name}: {g.dtype}"
        _check(g.detach(), r, dtype, f"{what} {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_model_document_attention(device, shape, dtype):
    """The models' attention module on documents: plait::document_attention (CUDA bf16: one FA2
    varlen call, MLA's values padded to 192; fp32: one math call per document; offsets padded to 16
    documents per row) equals each document alone."""
    q, k, v, dout = _inputs(device, dtype, shape)
    positions = to_device_with_segments(_document_positions(), device)
    attention = ScaledDotProductAttention(scale=0.1)
    _run(lambda *t: attention(*t, positions, offsets_of(positions)), q, k, v, dout, dtype, f"models {shape} {dtype}")


def test_flash_signature_found():
    line = flash_signature()
    print(line)
    assert "aten._flash_attention_forward" in line and "missing" not in line, line


@pytest.mark.cuda_only
@pytest.mark.parametrize("shape", SHAPES)
def test_varlen_is_one_flash_call_per_layer(device, shape):
    """bf16 on CUDA takes the varlen route: one aten._flash_attention_forward and one backward for
    the whole batch, whatever the documents (here 6 across 2 rows)."""
    q, k, v, dout = _inputs(device, torch.bfloat16, shape)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    assert kernel_route(q) == "varlen"
    positions = to_device_with_segments(_document_positions(), device)
    attention = ScaledDotProductAttention(scale=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, k, v, positions, offsets_of(positions)).backward(dout)
    names = [e.name for e in prof.events()]
    assert names.count("aten::_flash_attention_forward") == 1, names
    assert names.count("aten::_flash_attention_backward") == 1, names
    assert names.count("aten::_scaled_dot_product_flash_attention") == 0


@pytest.mark.cuda_only
def test_compiled_document_block(device):
    """A document-masked Llama 3 block compiled with inductor, fullgraph: the op traces through its
    fake kernel and runs varlen; equal to the eager block within bf16 noise."""
    args = llama3.ModelArgs(dim=512, n_layers=1, n_heads=8, n_kv_heads=2, vocab_size=256, max_seq_len=SEQ,
                            multiple_of=64, attention_mask="document")
    model = llama3.Transformer(args).to(device)
    model.init_weights()
    model.to(torch.bfloat16)
    block = model.layers["0"]
    positions = to_device_with_segments(_document_positions(), device)
    cos, sin = llama3.rope.rope_at(model.rope_cos, model.rope_sin, torch.arange(SEQ, device=device))
    x = torch.randn(2, SEQ, 512, device=device, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True)
    got, want = compiled(x, cos, sin, positions, offsets_of(positions)), block(x, cos, sin, positions, offsets_of(positions))
    _check(got.detach(), want.detach().float(), torch.bfloat16, "compiled block")
    (g_got,) = torch.autograd.grad(got.float().sum(), x)
    (g_want,) = torch.autograd.grad(want.float().sum(), x)
    _check(g_got, g_want.float(), torch.bfloat16, "compiled block dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
def test_context_parallel_documents_on_one_rank_group(device, one_rank_mesh, method, dtype):
    """contextparallel's document plans on the real autograd functions and collectives of a 1-rank
    group (NCCL on CUDA), with the flash kernels (bf16 on CUDA: the causal squares in one FA2
    varlen call, merged with the other blocks through the lse): equal to each document alone."""
    q, k, v, dout = _inputs(device, dtype, "gqa")
    positions = _document_positions().to(device)
    attention = ContextParallelAttention(one_rank_mesh, method, SequenceLayout(1, True), scale=0.1)
    _run(lambda *t: attention(*t, positions), q, k, v, dout, dtype, f"cp {method} {dtype}")


@pytest.mark.cuda_only
@pytest.mark.parametrize("method", ["allgather", "ring", "ulysses"])
def test_context_parallel_diagonal_is_one_varlen_call(device, one_rank_mesh, method):
    """Under CP the documents' causal squares are one aten._flash_attention_forward / backward per
    layer, however many documents the rows hold (here 6)."""
    q, k, v, dout = _inputs(device, torch.bfloat16, "gqa")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    positions = to_device_with_segments(_document_positions(), device)
    attention = ContextParallelAttention(one_rank_mesh, method, SequenceLayout(1, True), scale=0.1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        attention(q, k, v, positions).backward(dout)
    names = [e.name for e in prof.events()]
    # The other blocks' SDPA flash calls run aten::_flash_attention_forward / _backward inside.
    sdpa = names.count("aten::_scaled_dot_product_flash_attention")
    sdpa_backward = names.count("aten::_scaled_dot_product_flash_attention_backward")
    assert names.count("aten::_flash_attention_forward") - sdpa == 1, names
    assert names.count("aten::_flash_attention_backward") - sdpa_backward == 1, names


@pytest.mark.cuda_only
@pytest.mark.parametrize("where", ["models", "allgather", "ring", "ulysses"])
def test_document_step_does_not_sync_when_segments_were_read_first(device, one_rank_mesh, where):
    """The trainer's path: segments read from the CPU tensor, the tensor moved with them; a whole
    forward + backward then runs under set_sync_debug_mode("error")."""
    q, k, v, dout = (t.requires_grad_() if i < 3 else t for i, t in enumerate(_inputs(device, torch.bfloat16, "gqa")))
    cpu_positions = _document_positions()
    row_segments(cpu_positions)
    positions = to_device_with_segments(cpu_positions, device)
    if where == "models":
        attention, offsets = ScaledDotProductAttention(scale=0.1), offsets_of(positions)

        def attend(*t):
            return attention(*t, positions, offsets)
    else:
        attention = ContextParallelAttention(one_rank_mesh, where, SequenceLayout(1, True), scale=0.1)

        def attend(*t):
            return attention(*t, positions)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            attend(q, k, v).backward(dout)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
