import dataclasses
from collections import Counter

import pytest
import torch
from llama3_testing import build_initialised
from torch import nn

from plait.models.llama3 import FLAVORS, Transformer
from plait.models.llama3.rope import rope_tables

INIT_FUNCTIONS = ("normal_", "trunc_normal_", "ones_", "zeros_", "uniform_", "xavier_uniform_", "kaiming_uniform_")


@pytest.fixture
def init_counts(monkeypatch) -> Counter:
    """Counts, per tensor id, the nn.init calls made while the fixture is active."""
    counts = Counter()
    for name in INIT_FUNCTIONS:
        original = getattr(nn.init, name)

        def counting(tensor, *args, _original=original, **kwargs):
            counts[id(tensor)] += 1
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(nn.init, name, counting)
    return counts


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_every_parameter_initialised_exactly_once(tiny_args, init_counts, tie_embeddings):
    args = dataclasses.replace(tiny_args, tie_embeddings=tie_embeddings)
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    init_counts.clear()  # only what init_weights does
    model.init_weights()
    params = dict(model.named_parameters())  # a tied matrix appears once
    assert {name: init_counts[id(p)] for name, p in params.items()} == {name: 1 for name in params}
    assert sum(init_counts.values()) == len(params)


def test_tie_survives_to_empty(tiny_args):
    model = build_initialised(dataclasses.replace(tiny_args, tie_embeddings=True))
    assert model.output.weight is model.tok_embeddings.weight
    assert set(model.state_dict()) >= {"output.weight", "tok_embeddings.weight"}


def _std(t: torch.Tensor) -> float:
    return t.float().std().item()


@pytest.mark.parametrize("depth_init", [True, False])
def test_init_on_meta_then_to_empty_is_finite_and_scaled(depth_init):
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=3, depth_init=depth_init)
    model = build_initialised(args)
    for name, param in model.named_parameters():
        assert torch.isfinite(param).all(), name

    assert _std(model.tok_embeddings.weight) == pytest.approx(1.0, rel=0.02)
    # Truncation at 3 std shrinks the std by ~1.3%.
    out_std = args.dim**-0.5
    assert _std(model.output.weight) == pytest.approx(out_std * 0.987, rel=0.03)
    assert model.output.weight.abs().max() <= 3 * out_std
    assert torch.equal(model.norm.weight, torch.ones(args.dim))
    for layer_id, block in model.layers.items():
        depth = int(layer_id) + 1 if depth_init else args.n_layers
        out_proj_std = 0.02 / (2 * depth) ** 0.5
        for w in (block.attention.wq, block.attention.wk, block.attention.wv, block.feed_forward.w1):
            assert _std(w.weight) == pytest.approx(0.02, rel=0.05)
        for w in (block.attention.wo, block.feed_forward.w2, block.feed_forward.w3):
            assert _std(w.weight) == pytest.approx(out_proj_std, rel=0.05)
        assert torch.equal(block.attention_norm.weight, torch.ones(args.dim))
        assert torch.equal(block.ffn_norm.weight, torch.ones(args.dim))


def test_init_weights_recomputes_rope_tables(tiny_args):
    model = build_initialised(tiny_args)
    cos_LK, sin_LK = rope_tables(
        tiny_args.head_dim, tiny_args.max_seq_len, tiny_args.rope_theta, tiny_args.rope_scaling
    )
    assert model.rope_cos.device.type == "cpu"
    torch.testing.assert_close(model.rope_cos, cos_LK)
    torch.testing.assert_close(model.rope_sin, sin_LK)
    assert "rope_cos" not in model.state_dict()  # derived, never checkpointed


def test_same_seed_same_weights(tiny_args):
    a, b = build_initialised(tiny_args, seed=3), build_initialised(tiny_args, seed=3)
    for (name, pa), pb in zip(a.state_dict().items(), b.state_dict().values()):
        assert torch.equal(pa, pb), name
