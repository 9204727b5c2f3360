"""DeepSeek-V3 model: flavor sizes on meta, forward/backward, init, RoPE/YaRN, parallel_info."""

import dataclasses
import math

import pytest
import torch

from plait.models.deepseek_v3 import FLAVORS, ModelArgs, Transformer
from plait.models.deepseek_v3.rope import softmax_scale, yarn_frequencies

# Published totals and activated parameters (DeepSeek-V2-Lite, V2, V3 papers; Kimi K2's model card:
# 32B activated, the total as its Hugging Face page counts the release, 1.03T, the card's "1T").
PUBLISHED = {"16B": (15.7e9, 2.4e9), "236B": (236e9, 21e9), "671B": (671e9, 37e9), "kimi_k2": (1.03e12, 32e9)}


def _tiny(**overrides) -> ModelArgs:
    """debugmodel's structure at a size that runs in well under a second on CPU."""
    small = dict(
        vocab_size=256,
        dim=64,
        inter_dim=128,
        moe_inter_dim=32,
        n_layers=3,
        n_heads=4,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        max_seq_len=128,
        original_seq_len=32,
    )
    return dataclasses.replace(FLAVORS["debugmodel"], **{**small, **overrides})


def _model(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("name", list(FLAVORS))
def test_flavor_builds_on_meta_with_counted_params(name):
    with torch.device("meta"):
        model = Transformer(FLAVORS[name])
    total, active = model.param_counts()
    assert total == sum(p.numel() for p in model.parameters())
    args = FLAVORS[name]
    moe_layers = args.n_layers - args.n_dense_layers
    assert model.layers[str(args.n_layers - 1)].moe.experts.w1.shape == (
        args.n_routed_experts,
        args.dim,
        args.moe_inter_dim,
    )
    assert (
        total - active
        == moe_layers * (args.n_routed_experts - args.n_activated_experts) * 3 * args.dim * args.moe_inter_dim
    )
    if name in PUBLISHED:
        published_total, published_active = PUBLISHED[name]
        assert abs(total / published_total - 1) < 0.01
        # Papers round activated counts (to 0.1B / 1B) and differ on whether embeddings count;
        # without the input embedding (a lookup, not compute) all three land within 2.5%.
        # 671B: 37.55B with it, 36.63B without.
        assert abs((active - args.vocab_size * args.dim) / published_active - 1) < 0.025


def test_kimi_k2_is_deepseek_v3_at_its_released_size():
    args = FLAVORS["kimi_k2"]
    with torch.device("meta"):
        model = Transformer(args)
    assert model.param_counts() == (1_026_408_209_408, 32_861_477_888)
    assert (args.n_routed_experts, args.n_shared_experts, args.n_heads, args.n_dense_layers) == (384, 1, 64, 1)
    assert (args.n_expert_groups, args.n_limited_groups, args.route_scale) == (1, 1, 2.827)
    # YaRN x32 over 4096 positions from theta 50000, beta_fast = beta_slow = 1: on at 16K positions.
    assert args.uses_yarn and (args.rope_theta, args.rope_factor, args.beta_fast, args.beta_slow) == (5e4, 32, 1, 1)
    freqs, plain = yarn_frequencies(args), yarn_frequencies(dataclasses.replace(args, rope_factor=1.0))
    assert freqs[0] == plain[0] and freqs[-1] == pytest.approx(plain[-1] / 32)


def test_671b_is_v3_and_its_flops_count_active_experts_only():
    args = FLAVORS["671B"]
    with torch.device("meta"):
        model = Transformer(args)
    total, active = model.param_counts()
    assert (args.n_routed_experts, args.n_activated_experts, args.score_func) == (256, 8, "sigmoid")
    flops = model.flops_per_token(4096)
    attention = 6 * 61 * 128 * (192 + 128) * 4096
    assert flops == 6 * (active - args.vocab_size * args.dim) + attention
    assert flops < 6 * total / 10  # nowhere near dense-671B cost


def test_debugmodel_forward_backward():
    model = _model(dataclasses.replace(FLAVORS["debugmodel"], n_layers=2))
    tokens = torch.randint(0, 2048, (1, 16))
    logits = model(tokens)
    assert logits.shape == (1, 16, 2048) and torch.isfinite(logits).all()
    logits.float().logsumexp(-1).mean().backward()
    assert all(p.grad is not None for n, p in model.named_parameters()), "every parameter gets a gradient"


@pytest.mark.parametrize("dtype,q_lora_rank", [(torch.float32, 0), (torch.bfloat16, 16)])
def test_forward_backward_dtypes(dtype, q_lora_rank):
    model = _model(_tiny(q_lora_rank=q_lora_rank)).to(dtype)
    tokens = torch.randint(0, 256, (2, 12))
    loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), tokens.flatten())
    assert math.isfinite(loss.item()) and 4 < loss.item() < 8  # ~ln(256) at init
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name


def test_grouped_mm_model_matches_loop_model():
    tokens = torch.randint(0, 256, (2, 12))
    grouped = _model(_tiny(use_grouped_mm=True))
    loop = _model(_tiny(use_grouped_mm=False))
    torch.testing.assert_close(grouped(tokens), loop(tokens), atol=1e-5, rtol=1e-5)


def test_explicit_positions_equal_default_and_shards_match():
    model = _model(_tiny())
    tokens = torch.randint(0, 256, (2, 12))
    full = model(tokens)
    torch.testing.assert_close(model(tokens, torch.arange(12)), full)
    torch.testing.assert_close(model(tokens, torch.arange(12).expand(2, 12)), full)
    # RoPE is relative: a prefix or a uniform shift keeps the logits, other spacings do not.
    torch.testing.assert_close(model(tokens[:, :6], torch.arange(6)), full[:, :6], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(model(tokens, torch.arange(12) + 3), full, atol=1e-5, rtol=1e-5)
    # At init attention is nearly uniform, so look at one attention layer with sharper weights.
    from plait.models.llama3.rope import rope_at

    attention = model.layers["0"].attention
    with torch.no_grad():
        for p in attention.parameters():
            p.mul_(10)
    x = torch.randn(2, 12, 64)
    outs = [
        attention(x, *rope_at(model.rope_cos, model.rope_sin, pos))
        for pos in (torch.arange(12), torch.arange(12) + 3, torch.arange(12) * 2)
    ]
    torch.testing.assert_close(outs[1], outs[0], atol=1e-4, rtol=1e-4)
    assert (outs[2] - outs[0]).abs().max() > 1e-2 * outs[0].abs().max()


def test_yarn_only_beyond_original_context():
    plain = _tiny(max_seq_len=32, original_seq_len=32)
    yarn = _tiny(max_seq_len=128, original_seq_len=32, rope_factor=4.0, mscale=0.7)
    base = yarn_frequencies(plain)
    scaled = yarn_frequencies(yarn)
    assert softmax_scale(plain) == plain.qk_head_dim**-0.5
    assert softmax_scale(yarn) == pytest.approx(yarn.qk_head_dim**-0.5 * (0.1 * 0.7 * math.log(4.0) + 1) ** 2)
    # High frequencies kept, the lowest interpolated by rope_factor.
    assert scaled[0] == base[0]
    assert scaled[-1] == pytest.approx(base[-1] / 4.0)


def test_init_weights_after_meta_covers_every_parameter_and_buffer():
    args = _tiny()
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data.fill_(float("nan"))
    model.init_weights(buffer_device="cpu")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor).all(), name
    reference = _model(args)
    torch.testing.assert_close(model.rope_cos, reference.rope_cos)
    router = model.layers["2"].moe.router
    assert torch.all(router.expert_bias == 0) and torch.all(router.tokens_per_expert == 0)
    # depth-scaled output projections
    assert model.layers["2"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()


def test_parallel_info_paths_exist():
    import fnmatch

    model = _model(_tiny(n_dense_layers=1, q_lora_rank=16))
    info = model.parallel_info()
    modules = dict(model.named_modules())
    assert info["blocks"] == ["layers.0", "layers.1", "layers.2"]
    assert info["experts"] == ["layers.1.moe.experts", "layers.2.moe.experts"]
    assert all(p in modules for p in info["experts"] + info["attention_modules"])
    # Each MoE's shared experts run after its experts and before their output is used.
    assert info["expert_overlap"] == {f"layers.{i}.moe.experts": f"layers.{i}.moe.shared_experts" for i in (1, 2)}
    for pattern in info["tp_plan"]:
        assert any(fnmatch.fnmatchcase(path, pattern) for path in modules), pattern
    assert "layers.*.attention.wq_b" in info["tp_plan"] and "layers.*.attention.wq" not in info["tp_plan"]
    assert info["tp_plan"]["layers.*.moe"] == "moe_input_output"
