"""Qwen3 dense and MoE: released sizes on meta, FLOPs, init, forward/backward, parallel_info."""

import dataclasses
import fnmatch
import json

import pytest
import torch
import torch.nn.functional as F

from plait.models import build_model, get_model_spec
from plait.models.qwen3 import FLAVORS, ModelArgs, Transformer

# Parameters counted on meta, and the model cards' rounded totals (Qwen3 technical report, Table 1
# and 2; the cards' non-embedding counts leave out the embedding and the untied head).
EXPECTED = {
    # name: (parameters, card total, card non-embedding, card active; in billions)
    "debugmodel": (5_770_880, None, None, None),
    "debugmodel_moe": (11_681_408, None, None, None),
    "0.6B": (596_049_920, 0.6, 0.44, None),
    "1.7B": (1_720_574_976, 1.7, 1.4, None),
    "4B": (4_022_468_096, 4.0, 3.6, None),
    "8B": (8_190_735_360, 8.2, 6.95, None),
    "14B": (14_768_307_200, 14.8, 13.2, None),
    "32B": (32_762_123_264, 32.8, 31.2, None),
    "30B-A3B": (30_532_122_624, 30.5, 29.9, 3.3),
    "235B-A22B": (235_093_634_560, 235, 234, 22),
}


def test_every_flavor_is_checked():
    assert set(FLAVORS) == set(EXPECTED)
    assert get_model_spec("qwen3").flavors is FLAVORS


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_count_on_meta_is_the_release(name):
    args = FLAVORS[name]
    with torch.device("meta"):
        model = Transformer(args)
        if not args.is_moe:  # (torch's meta grouped_mm takes bf16 only)
            assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, args.vocab_size)
    n_params = sum(p.numel() for p in model.parameters())  # a tied matrix once
    total, active = model.param_counts()
    expected, card_total, card_non_embedding, card_active = EXPECTED[name]
    assert n_params == total == expected
    if card_total is not None:  # the cards round: within 2 %
        non_embedding = n_params - args.vocab_size * args.dim * (1 if args.tie_embeddings else 2)
        assert n_params / 1e9 == pytest.approx(card_total, rel=0.02)
        assert non_embedding / 1e9 == pytest.approx(card_non_embedding, rel=0.02)
        assert (args.head_dim, args.vocab_size, args.rope_theta, args.norm_eps) == (128, 151936, 1e6, 1e-6)
    if card_active is not None:
        assert active / 1e9 == pytest.approx(card_active, rel=0.02)
    assert (active < total) == args.is_moe
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_embeddings
    block = model.layers["0"]
    assert block.attention.wq.weight.shape == (args.n_heads * args.head_dim, args.dim)
    assert block.attention.q_norm.weight.shape == (args.head_dim,)
    assert block.is_moe == args.is_moe


def test_flops_per_token_count_active_non_embedding_parameters():
    for name in ("8B", "0.6B", "30B-A3B", "debugmodel_moe"):
        args = FLAVORS[name]
        with torch.device("meta"):
            model = Transformer(args)
        params = {n: p.numel() for n, p in model.named_parameters(remove_duplicate=False)}
        non_embedding = sum(v for n, v in params.items() if n != "tok_embeddings.weight")  # a tied head counts
        if args.is_moe:  # only the top-k experts of each block compute per token
            idle = 1 - args.n_activated_experts / args.n_routed_experts
            non_embedding -= idle * sum(v for n, v in params.items() if ".moe.experts." in n)
        attention = 12 * args.n_layers * args.n_heads * args.head_dim * 4096
        assert model.flops_per_token(4096) == pytest.approx(6 * non_embedding + attention, rel=1e-12), name


def _tiny(**overrides) -> ModelArgs:
    return dataclasses.replace(FLAVORS["debugmodel_moe"], n_layers=2, vocab_size=256, max_seq_len=64, **overrides)


def _model(args: ModelArgs, seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(args)
    model.init_weights()
    return model


@pytest.mark.parametrize("moe", [False, True])
def test_forward_backward_reaches_every_parameter(moe):
    args = _tiny(n_routed_experts=8 if moe else 0)
    model = _model(args)
    tokens = torch.randint(0, args.vocab_size, (2, 16))
    logits = model(tokens)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
    # Output std dim**-0.5 on unit-RMS hidden states: ~unit logits, a loss near log(V).
    assert abs(loss.item() - torch.log(torch.tensor(float(args.vocab_size))).item()) < 1.0
    loss.backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name


def test_grouped_mm_experts_match_the_loop():
    tokens = torch.randint(0, 256, (2, 12))
    torch.testing.assert_close(_model(_tiny())(tokens), _model(_tiny(use_grouped_mm=False))(tokens), atol=1e-5, rtol=1e-5)


def test_qk_norm_weights_act_per_head_before_rope():
    model = _model(_tiny(n_routed_experts=0))
    tokens = torch.randint(0, 256, (1, 12))
    before = model(tokens)
    with torch.no_grad():
        model.layers["0"].attention.k_norm.weight.mul_(4.0)  # sharper attention in layer 0 only
    assert (model(tokens) - before).abs().max() > 1e-3
    # RoPE is relative: a uniform shift of the positions keeps the logits.
    torch.testing.assert_close(model(tokens, torch.arange(12) + 5), model(tokens), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie", [False, True])
def test_init_after_meta_covers_everything_and_keeps_the_tie(tie):
    args = _tiny(tie_embeddings=tie)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    assert (model.output.weight is model.tok_embeddings.weight) == tie  # re-tied after to_empty
    for tensor in [*model.parameters(), *model.buffers()]:
        tensor.data.fill_(float("nan"))
    model.init_weights(buffer_device="cpu")
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        assert torch.isfinite(tensor).all(), name
    torch.testing.assert_close(model.rope_cos, _model(args).rope_cos)
    assert torch.all(model.layers["1"].moe.router.expert_bias == 0)
    assert all(torch.all(m.weight == 1) for m in model.modules() if isinstance(m, torch.nn.RMSNorm))
    assert model.layers["1"].attention.wo.weight.std() < model.layers["0"].attention.wo.weight.std()  # depth init


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe", "4B"])
def test_parallel_info_is_plain_data_naming_real_modules(flavor):
    with torch.device("meta"):
        model = build_model("qwen3", flavor)
    args, info = model.args, model.parallel_info()
    assert json.loads(json.dumps(info)) == info
    modules = dict(model.named_modules())
    assert info["blocks"] == [f"layers.{i}" for i in range(args.n_layers)]
    for pattern in info["tp_plan"]:  # "*" is one path component; every pattern names a module
        assert any(fnmatch.fnmatchcase(p, pattern) and p.count(".") == pattern.count(".") for p in modules), pattern
    for path, module in modules.items():  # and every parameter is covered
        if next(module.parameters(recurse=False), None) is not None:
            assert any(fnmatch.fnmatchcase(path, p) and path.count(".") == p.count(".") for p in info["tp_plan"]), path
    assert info["tp_plan"]["layers.*.attention.q_norm"] == info["tp_plan"]["layers.*.attention.k_norm"] == "head_norm"
    assert info["attention_heads"] == {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim}
    assert all(p in modules for p in info["attention_modules"] + info["experts"])
    assert info["experts"] == ([f"layers.{i}.moe.experts" for i in range(args.n_layers)] if args.is_moe else [])
    assert info["expert_overlap"] == {}  # no shared expert
    assert info["edge_units"] == ([] if args.tie_embeddings else [["tok_embeddings"], ["norm", "output"]])
    assert ("ffn_hidden" in info["tp_divisible"]) != args.is_moe


def test_args_refuse_in_one_line():
    with pytest.raises(ValueError, match="n_kv_heads"):
        _tiny(n_kv_heads=3)
    with pytest.raises(ValueError, match="n_activated_experts 9 not in"):
        _tiny(n_activated_experts=9)
    with pytest.raises(ValueError, match="head_dim 31"):
        _tiny(head_dim=31)
    assert not _tiny(n_routed_experts=0, n_activated_experts=9).is_moe  # a dense model ignores the MoE sizes
