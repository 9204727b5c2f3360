"""DeepSeek-V3's release format: block-FP8 weights with `weight_scale_inv`, dequantised on import,
against a reference computed block by block here; a tiny FP8 checkpoint written by the test."""

import json

import pytest
import torch

from plait.models.deepseek_v3 import ModelArgs, Transformer
from plait.models.hf import deepseek_v3 as adapter
from plait.models.hf.convert import from_hf, load_plait_state_dict
from plait.models.hf.fp8 import dequantize_block_fp8, dequantize_state_dict
from plait.models.hf.io import save_safetensors

FP8_MAX = torch.finfo(torch.float8_e4m3fn).max


def quantize(w_OI: torch.Tensor, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """What the release did: per block, scale_inv = amax / 448 and W_fp8 = W / scale_inv."""
    n_out, n_in = w_OI.shape
    scale_inv = torch.empty(-(-n_out // rows), -(-n_in // cols))
    q = torch.empty(n_out, n_in, dtype=torch.float8_e4m3fn)
    for b in range(scale_inv.shape[0]):
        for c in range(scale_inv.shape[1]):
            block = w_OI[b * rows : (b + 1) * rows, c * cols : (c + 1) * cols]
            scale_inv[b, c] = block.abs().max().clamp(min=1e-12) / FP8_MAX
            q[b * rows : (b + 1) * rows, c * cols : (c + 1) * cols] = (block / scale_inv[b, c]).to(torch.float8_e4m3fn)
    return q, scale_inv


def reference(q: torch.Tensor, scale_inv: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Block by block, the plain loop: each block's fp8 values times its one scale."""
    out = torch.empty(q.shape)
    for b in range(scale_inv.shape[0]):
        for c in range(scale_inv.shape[1]):
            block = (slice(b * rows, (b + 1) * rows), slice(c * cols, (c + 1) * cols))
            out[block] = q[block].float() * scale_inv[b, c]
    return out


def test_128_blocks_with_partial_edges():
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.logspace(-3, 1, 300).unsqueeze(1)  # blocks of very different scale
    q, s = quantize(w, 128, 128)
    assert s.shape == (3, 2)
    got = dequantize_block_fp8(q, s)
    assert torch.equal(got, reference(q, s, 128, 128))
    # e4m3 keeps 3 mantissa bits: every value within 1/16 of its block's largest magnitude.
    block_max = (s * FP8_MAX).repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :200]
    assert bool(((got - w).abs() <= block_max / 16).all())
    assert dequantize_block_fp8(q, s, dtype=torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="does not tile"):
        dequantize_block_fp8(q, s[:2])
    with pytest.raises(ValueError, match="no x_scale_inv"):
        dequantize_state_dict({"x": q})


ARGS = ModelArgs(vocab_size=128, dim=64, inter_dim=96, moe_inter_dim=48, n_layers=2, n_dense_layers=1, n_heads=4,
                 n_routed_experts=4, n_shared_experts=1, n_activated_experts=2, score_func="sigmoid",
                 q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                 max_seq_len=64, mtp_layers=1)  # the release's one MTP layer: quantised like the others


def test_fp8_release_checkpoint_imports(tmp_path):
    torch.manual_seed(0)
    model = Transformer(ARGS)
    model.init_weights()
    hf_sd = adapter.to_hf(model.state_dict(), ARGS)
    rows, cols = 32, 32  # the release's [128, 128] scaled down so the tiny model has several blocks
    written, expected = {}, {}
    for name, w in hf_sd.items():
        # As released: the projections are FP8 (the MTP layer's eh_proj and block too), norms /
        # embeddings / router / head (and the MTP layer's copies of the last two) are not.
        if name.endswith("proj.weight") or ".experts." in name:
            q, s = quantize(w, rows, cols)
            written[name], written[name.replace(".weight", ".weight_scale_inv")] = q, s
            expected[name] = reference(q, s, rows, cols)
        else:
            written[name] = expected[name] = w
    hf_dir, out = tmp_path / "hf", tmp_path / "plait.pt"
    save_safetensors(written, hf_dir, max_shard_size="100KB")  # sharded, as the release is
    config = adapter.hf_config(ARGS)
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [rows, cols]}
    (hf_dir / "config.json").write_text(json.dumps(config))
    from_hf("deepseek_v3", None, str(hf_dir), str(out), torch.float32)
    got = load_plait_state_dict(out)
    want = adapter.from_hf(expected, ARGS)
    assert set(got) == set(model.state_dict())
    for name in want:
        assert got[name].dtype == torch.float32 and torch.equal(got[name], want[name]), name
    # And the weights are the model's up to FP8 rounding: the logits barely move.
    back = Transformer(ARGS)
    back.load_state_dict(got)
    tokens = torch.randint(0, ARGS.vocab_size, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(tokens), model(tokens), atol=0.05, rtol=0.05)
