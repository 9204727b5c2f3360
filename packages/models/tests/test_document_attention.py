"""plait::document_attention: one op per layer on every device, the per-document kernels unchanged."""

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from plait.models import cpu_bf16, llama3
from plait.models.document_attention import (
    document_attention,
    document_attention_flops,
    flash_window_kwargs,
    kernel_route,
    segment_loop_attention,
)
from plait.models.documents import document_offsets, documents_capacity, offsets_of, to_device_with_segments

ROWS = ((0, 5, 6, 22, 52, 64), (0, 64))  # a row of five documents (one of 1 token) and a row of one


def _qkv(dtype, heads=4, kv_heads=2, head_dim=32, v_dim=None, seq=64, rows=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = rows * seq
    q = torch.randn(T, heads, head_dim, generator=g).to(dtype).requires_grad_()
    k = torch.randn(T, kv_heads, head_dim, generator=g).to(dtype).requires_grad_()
    v = torch.randn(T, kv_heads, v_dim or head_dim, generator=g).to(dtype).requires_grad_()
    return q, k, v


def _old_per_segment(q_THA, k_TGA, v_TGA, rows, seq, scale):
    """What the models ran before the op: one causal SDPA call per segment, autograd through SDPA."""
    gqa = q_THA.shape[1] != k_TGA.shape[1]
    dv, dqk = v_TGA.shape[-1], q_THA.shape[-1]
    outs = []
    for r, bounds in enumerate(rows):
        for s, e in zip(bounds, bounds[1:]):
            sl = slice(r * seq + s, r * seq + e)
            q, k, v = (t[sl].transpose(0, 1).unsqueeze(0) for t in (q_THA, k_TGA, v_TGA))
            low = q.dtype != torch.float32
            if low and cpu_bf16.cpu_attends_in_fp32(dqk):
                out = F.scaled_dot_product_attention(
                    q.float(), k.float(), F.pad(v.float(), (0, dqk - dv)), is_causal=True, scale=scale, enable_gqa=gqa
                )[..., :dv].to(q.dtype)
            else:
                out = F.scaled_dot_product_attention(
                    q, k, F.pad(v, (0, dqk - dv)), is_causal=True, scale=scale, enable_gqa=gqa
                )[..., :dv]
            outs.append(out[0].transpose(0, 1))
    return torch.cat(outs)


def _grads(fn, q, k, v, dout):
    out = fn(q, k, v)
    q_g, k_g, v_g = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), q_g, k_g, v_g


@pytest.mark.parametrize(
    "dtype,v_dim", [(torch.float32, None), (torch.float32, 16), (torch.bfloat16, None)], ids=["fp32", "fp32-mla", "bf16"]
)
def test_op_equals_the_per_segment_loop(dtype, v_dim):
    """fp32: bitwise the kernels the models called per segment (GQA, MLA's narrower values);
    bf16: within one bf16 ulp-scale of them (the backward reads the output rounded to bf16, as
    FA2's does, where SDPA's autograd kept the fp32 route's unrounded one)."""
    q, k, v = _qkv(dtype, v_dim=v_dim, heads=4 if v_dim is None else 2, kv_heads=2)
    offsets = document_offsets(ROWS, 64, capacity=8)
    assert offsets.shape == (2 * 8 + 1,) and offsets[-1] == 128 and offsets.dtype == torch.int32
    dout = torch.randn(q.shape[0], q.shape[1], v.shape[-1]).to(dtype)
    got = _grads(lambda *t: document_attention(*t, offsets, 64, 0.3), q, k, v, dout)
    want = _grads(lambda *t: _old_per_segment(*t, ROWS, 64, 0.3), q, k, v, dout)
    loop = _grads(lambda *t: segment_loop_attention(*t, offsets.tolist(), 0.3), q, k, v, dout)
    for g, w, lp in zip(got, want, loop):
        if dtype == torch.float32:
            assert torch.equal(g, w)
            torch.testing.assert_close(lp, w, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def test_one_op_per_layer_whatever_the_documents():
    """A document-masked model dispatches the same ops for 1 and for 16 documents per row, one
    plait::document_attention per layer forward and one backward per layer."""

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    args = llama3.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=128,
                            multiple_of=32, attention_mask="document", rope_positions="document")
    torch.manual_seed(0)
    model = llama3.Transformer(args)
    model.init_weights()
    counts = []
    for docs in (1, 16):
        positions = torch.arange(128).remainder(128 // docs).int().expand(2, 128).contiguous()
        positions = to_device_with_segments(positions, "cpu", capacity=16)
        with Count() as c:
            model(torch.zeros(2, 128, dtype=torch.long), document_positions=positions).sum().backward()
        model.zero_grad(set_to_none=True)
        counts.append(c.ops)
        assert c.ops.count("plait.document_attention") == 2
        assert c.ops.count("plait.document_attention_backward") == 2
    assert counts[0] == counts[1]


def test_block_compiles_without_graph_break():
    """The document-masked block is one graph (fullgraph=True), forward and backward, and computes
    what the eager block does."""
    args = llama3.ModelArgs(dim=64, n_layers=1, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=128,
                            multiple_of=32, attention_mask="document")
    torch.manual_seed(0)
    model = llama3.Transformer(args)
    model.init_weights()
    block = model.layers["0"]
    positions = torch.tensor([list(range(40)) + list(range(88))] * 2, dtype=torch.int32)
    offsets = offsets_of(positions)
    cos, sin = llama3.rope.rope_at(model.rope_cos, model.rope_sin, torch.arange(128))
    x = torch.randn(2, 128, 64, requires_grad=True)
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    got = compiled(x, cos, sin, positions, offsets)
    want = block(x, cos, sin, positions, offsets)
    torch.testing.assert_close(got, want)
    (g_got,) = torch.autograd.grad(got.sum(), x)
    (g_want,) = torch.autograd.grad(want.sum(), x)
    torch.testing.assert_close(g_got, g_want)


def test_offsets_capacity_and_shape():
    assert documents_capacity(ROWS) == 16
    assert documents_capacity(((0,) + tuple(range(1, 41)),)) == 64  # 40 documents: doubled from 16
    offsets = document_offsets(ROWS, 64, 16)
    assert offsets.tolist()[:8] == [0, 5, 6, 22, 52, 64, 128, 128]
    with pytest.raises(ValueError, match="room for 2"):
        document_offsets(ROWS, 64, 2)


def test_route():
    q, _, _ = _qkv(torch.bfloat16)
    assert kernel_route(q) == "segments"  # the CPU; CUDA bf16 takes varlen (gpu/test_gpu_documents.py)
    assert kernel_route(q.to("meta")) == "segments"


def test_flash_signatures_both_torch_versions():
    """torch 2.13's aten._flash_attention_forward takes window sizes (causal: (-1, 0)); an older
    schema without them gets is_causal alone. Decided from the schema's argument names."""
    new = ["query", "key", "value", "is_causal", "scale", "window_size_left", "window_size_right"]
    old = ["query", "key", "value", "is_causal", "scale"]
    assert flash_window_kwargs(new) == {"window_size_left": -1, "window_size_right": 0}
    assert flash_window_kwargs(old) == {}
    names = {a.name for a in torch.ops.aten._flash_attention_forward.default._schema.arguments}
    assert flash_window_kwargs(names)  # this torch (2.13)


def test_flops_count_documents_not_rows():
    q, k, v = _qkv(torch.float32)
    offsets = document_offsets(ROWS, 64, 8)
    pairs = sum((e - s) * (e - s + 1) // 2 for r in ROWS for s, e in zip(r, r[1:]))
    assert document_attention_flops(q, v, offsets, 64) == pairs * 4 * (2 * 32 + 2 * 32)
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        document_attention(q, k, v, offsets, 64, 0.3).sum().backward()
    by_op = counter.get_flop_counts()["Global"]
    assert by_op[torch.ops.plait.document_attention] == pairs * 4 * 128
    assert by_op[torch.ops.plait.document_attention_backward] == pairs * 4 * 128 * 5 // 2
