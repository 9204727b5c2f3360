import dataclasses

import pytest
import torch
import torch.nn.functional as F
from llama3_testing import build_initialised
from torch import nn

from plait.models import cpu_bf16
from plait.models.common import ScaledDotProductAttention
from plait.models.llama3 import FLAVORS
from plait.models.llama3.rope import apply_rope, rope_at, rope_tables


def test_debugmodel_forward_backward():
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2)
    model = build_initialised(args)
    tokens = torch.randint(0, args.vocab_size, (2, 8))
    logits = model(tokens)
    assert logits.shape == (2, 8, args.vocab_size)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    # Output std dim**-0.5 on unit-RMS hidden states gives ~unit logits: loss near log(V).
    assert abs(loss.item() - torch.log(torch.tensor(args.vocab_size)).item()) < 1.0
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
        assert param.grad.abs().sum() > 0, name


def test_default_positions_are_arange(tiny_args):
    model = build_initialised(tiny_args)
    tokens = torch.randint(0, tiny_args.vocab_size, (2, 12))
    expected = model(tokens)
    torch.testing.assert_close(model(tokens, torch.arange(12)), expected)
    torch.testing.assert_close(model(tokens, torch.arange(12).expand(2, 12)), expected)


def test_causal_prefix_equals_slice_of_full_forward(tiny_args):
    model = build_initialised(tiny_args)
    tokens = torch.randint(0, tiny_args.vocab_size, (2, 16))
    full = model(tokens)
    torch.testing.assert_close(model(tokens[:, :5], torch.arange(5)), full[:, :5])


def test_rope_gathers_table_rows_at_positions(tiny_args):
    cos_LK, sin_LK = rope_tables(tiny_args.head_dim, tiny_args.max_seq_len, 10000.0, tiny_args.rope_scaling)
    positions = torch.tensor([[3, 40, 7], [0, 63, 1]])
    cos, sin = rope_at(cos_LK, sin_LK, positions)
    assert cos.shape == (2, 3, 1, tiny_args.head_dim // 2)
    torch.testing.assert_close(cos[1, 1, 0], cos_LK[63])
    torch.testing.assert_close(sin[0, 1, 0], sin_LK[40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_the_pair_rotation_to_the_bit(dtype):
    """apply_rope's fused form gives the floats of the pair rotation written out, forward and backward."""

    def written_out(x_BSHD, cos, sin):
        x_even, x_odd = x_BSHD.float().unflatten(-1, (-1, 2)).unbind(-1)
        return torch.stack((x_even * cos - x_odd * sin, x_even * sin + x_odd * cos), dim=-1).flatten(-2).type_as(x_BSHD)

    torch.manual_seed(0)
    cos, sin = rope_at(*rope_tables(16, 512, 10000.0, None), torch.randint(0, 512, (2, 9)))
    x, grad = (torch.randn(2, 9, 3, 16).mul(10).to(dtype) for _ in range(2))
    results = []
    for rope in (apply_rope, written_out):
        leaf = x.clone().requires_grad_()
        y = rope(leaf, cos, sin)
        y.backward(grad)
        results.append((y.detach(), leaf.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))


def test_rope_only_sees_relative_positions():
    # Without scaling, shifting every position by the same offset leaves attention unchanged.
    args = FLAVORS["debugmodel"]
    args = dataclasses.replace(args, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64)
    model = build_initialised(args)
    tokens = torch.randint(0, args.vocab_size, (1, 10))
    torch.testing.assert_close(model(tokens, torch.arange(10) + 37), model(tokens), atol=1e-4, rtol=1e-4)


class PositionMaskedSDPA(nn.Module):
    """Causal by explicit positions rather than by order: what a CP attention does for
    load-balanced, non-contiguous sequence shards."""

    def __init__(self):
        super().__init__()
        self.positions_S = None

    def forward(self, q_BHSD, k_BHSD, v_BHSD):
        mask_SS = self.positions_S[:, None] >= self.positions_S[None, :]
        return F.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, attn_mask=mask_SS, enable_gqa=True)


def test_non_contiguous_positions_with_replaced_sdpa(tiny_args):
    model = build_initialised(tiny_args)
    tokens = torch.randint(0, tiny_args.vocab_size, (2, 48))
    full = model(tokens)

    # CP's load-balanced order for 2 ranks x 2 chunks: chunks 0 and 3 on rank 0, 1 and 2 on rank 1.
    order = torch.cat([torch.arange(0, 12), torch.arange(36, 48), torch.arange(12, 24), torch.arange(24, 36)])
    masked = PositionMaskedSDPA()
    masked.positions_S = order
    for block in model.layers.values():
        block.attention.sdpa = masked
    torch.testing.assert_close(model(tokens[:, order], order), full[:, order])


def test_attention_goes_through_the_sdpa_module(tiny_args, monkeypatch):
    model = build_initialised(tiny_args)
    calls = []
    original = ScaledDotProductAttention.forward

    def counting(self, q, k, v):
        calls.append((q.shape, k.shape, v.shape))
        return original(self, q, k, v)

    monkeypatch.setattr(ScaledDotProductAttention, "forward", counting)
    model(torch.randint(0, tiny_args.vocab_size, (2, 6)))
    # One call per layer; kv heads are not repeated to the query head count (native GQA).
    n_kv = tiny_args.n_kv_heads
    assert n_kv < tiny_args.n_heads
    assert calls == [((2, 4, 6, 16), (2, n_kv, 6, 16), (2, n_kv, 6, 16))] * tiny_args.n_layers


def test_attention_infers_local_head_count(tiny_args):
    # Tensor parallel leaves each rank wq/wk/wv with a slice of the heads; the forward must
    # work on the slice unchanged. Simulate rank 0 of 2 by slicing the weights.
    model = build_initialised(tiny_args)
    attention = model.layers["0"].attention
    head_dim = tiny_args.head_dim
    for linear, heads in ((attention.wq, 2), (attention.wk, 1), (attention.wv, 1)):
        linear.weight = nn.Parameter(linear.weight[: heads * head_dim])
    attention.wo.weight = nn.Parameter(attention.wo.weight[:, : 2 * head_dim])
    x = torch.randn(1, 5, tiny_args.dim)
    cos, sin = rope_at(model.rope_cos, model.rope_sin, torch.arange(5))
    assert attention(x, cos, sin).shape == (1, 5, tiny_args.dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sdpa_grouped_query_attention_equals_repeated_heads(dtype):
    # Native GQA (no K/V copies) must equal multi-head attention over kv heads repeated H / G times.
    torch.manual_seed(0)
    q = torch.randn(2, 8, 12, 16, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 12, 16, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 12, 16, dtype=dtype, requires_grad=True)
    out = ScaledDotProductAttention()(q, k, v)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float().repeat_interleave(4, dim=1), v.float().repeat_interleave(4, dim=1), is_causal=True
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)
    grads = torch.autograd.grad(out.float().sum(), (q, k, v))
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref2 = F.scaled_dot_product_attention(q2, k2.repeat_interleave(4, 1), v2.repeat_interleave(4, 1), is_causal=True)
    for got, want in zip(grads, torch.autograd.grad(ref2.sum(), (q2, k2, v2))):
        torch.testing.assert_close(got.float(), want, atol=5 * tol, rtol=5 * tol)


@pytest.mark.parametrize("bf16_units", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_narrower_values_attend_with_the_flash_kernel_in_bf16(autocast, bf16_units, monkeypatch):
    """MLA's v head dim (128) is below q/k's (192): in bf16 on CPU the module zero-pads v for the
    flash kernel instead of SDPA's math path; the result equals the math path's, backward too.
    On a CPU without native bf16 (no AVX512-BF16, no AMX) the kernel runs in fp32, where it is
    faster there; both branches are checked on any CPU."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", bf16_units)
    torch.manual_seed(0)
    dtype = torch.float32 if autocast else torch.bfloat16
    q, k = (torch.randn(2, 4, 32, 48, dtype=dtype, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 4, 32, 32, dtype=dtype, requires_grad=True)
    with (
        torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast),
        torch.profiler.profile(record_shapes=True) as prof,
    ):
        out = ScaledDotProductAttention()(q, k, v)
        out.float().square().sum().backward()
    flash = [e for e in prof.events() if e.name.startswith("aten::_scaled_dot_product_flash_attention_for_cpu")]
    assert {e.input_dtypes[0] for e in flash} == {"c10::BFloat16" if bf16_units else "float"}
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_scaled_dot_product_flash_attention_for_cpu" in ops
    assert "aten::_scaled_dot_product_attention_math" not in ops
    assert out.shape == (2, 4, 32, 32) and out.dtype == torch.bfloat16
    grads = [t.grad for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    qf, kf, vf = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(qf, kf, vf, is_causal=True)
    ref.square().sum().backward()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)
    for got, want in zip(grads, (qf.grad, kf.grad, vf.grad)):
        torch.testing.assert_close(got.float(), want, atol=5e-2 * float(want.abs().max()), rtol=5e-2)


def test_cpu_fp32_attention_keeps_values_wider_than_queries(monkeypatch):
    """The fp32 path pads only narrower values (MLA): values wider than q/k go through whole."""
    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", False)
    torch.manual_seed(0)
    q, k = (torch.randn(1, 2, 8, 32, dtype=torch.bfloat16) for _ in range(2))
    v = torch.randn(1, 2, 8, 48, dtype=torch.bfloat16)
    out = ScaledDotProductAttention()(q, k, v)
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    assert out.shape == (1, 2, 8, 48) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
