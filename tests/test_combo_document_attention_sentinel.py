"""The step sentinel on plait::document_attention: a document-masked step is sync-free and meets
FlashAttention-2 varlen's preconditions on CPU; each broken precondition is named."""

import pytest
import torch

from plait.models import deepseek_v3, llama3
from plait.models.document_attention import document_attention
from plait.models.documents import document_offsets, to_device_with_segments
from plait.testing.sentinel import StepSentinel


def _positions(batch=2, seq=64, docs=4):
    positions = torch.arange(seq).remainder(seq // docs).int().expand(batch, seq).contiguous()
    return to_device_with_segments(positions, torch.device("cpu"))


@pytest.mark.parametrize("family", ["llama3", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_document_step_is_sync_free_and_meets_varlen(family, dtype):
    torch.manual_seed(0)
    if family == "llama3":
        args = llama3.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=128,
                                multiple_of=32, attention_mask="document", rope_positions="document")
        model = llama3.Transformer(args)
    else:  # MLA: q/k head dim 32 (24 + 8), v 16: padded inside the op
        import dataclasses

        args = dataclasses.replace(
            deepseek_v3.FLAVORS["debugmodel"], vocab_size=128, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=1,
            n_heads=4, kv_lora_rank=32, qk_nope_head_dim=24, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=128,
            original_seq_len=32, attention_mask="document",
        )
        model = deepseek_v3.Transformer(args)
    model.init_weights()
    model.to(dtype)
    positions = _positions()
    tokens = torch.zeros(2, 64, dtype=torch.long)
    sentinel = StepSentinel("cpu", compute_dtype=dtype)
    with sentinel:
        model(tokens, document_positions=positions).float().sum().backward()
    assert sentinel.step_counts() == [(0, 0)], sentinel.report()
    assert not [k for k in sentinel.off_dtype_kernels if k[0].startswith("document_attention")], sentinel.off_dtype_kernels


def test_each_broken_varlen_precondition_is_named():
    q = torch.randn(64, 4, 32, dtype=torch.bfloat16)
    k = v = torch.randn(64, 2, 32, dtype=torch.bfloat16)
    good = document_offsets(((0, 10, 64),), 64, 4)
    cases = {
        "int32": (q, k, v, good.long()),
        "multiple of 8": (q[..., :12], k[..., :12], v[..., :12]),
        "stride(-1)": (torch.randn(64, 4, 64, dtype=torch.bfloat16)[..., ::2], k, v),
        "multiple of k's": (q[:, :3], k, v),
    }
    for expected, (qq, kk, vv, *cu) in cases.items():
        sentinel = StepSentinel("cpu")
        with sentinel:
            document_attention(qq, kk, vv, cu[0] if cu else good, 64, 0.2)
        details = " | ".join(r.detail for r in sentinel.violations)
        assert expected in details, (expected, details)
    sentinel = StepSentinel("cpu")
    with sentinel:
        document_attention(q, k, v, good, 64, 0.2)
    assert sentinel.violations == []


def test_a_causal_block_that_is_not_square_is_named():
    q = torch.randn(1, 2, 8, 16)
    kv = torch.randn(1, 2, 16, 16)
    sentinel = StepSentinel("cpu")
    with sentinel:
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, kv, kv, 0.0, True)
    assert any("not square" in r.detail for r in sentinel.violations), sentinel.report()
