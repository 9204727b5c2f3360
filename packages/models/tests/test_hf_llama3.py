"""plait Llama 3 <-> transformers LlamaForCausalLM: same logits both ways."""

import dataclasses
import json

import pytest
import torch
from llama3_testing import build_initialised

from plait.models.hf import llama3 as adapter
from plait.models.hf.io import load_safetensors, save_safetensors
from plait.models.llama3 import FLAVORS, Transformer

transformers = pytest.importorskip("transformers")


def export(model: Transformer, out_dir, **save_kwargs):
    save_safetensors(adapter.to_hf(model.state_dict(), model.args), out_dir, **save_kwargs)
    (out_dir / "config.json").write_text(json.dumps(adapter.hf_config(model.args)))


def test_rotary_permutation_is_inverted():
    w_OI = torch.randn(4 * 8, 5)
    half = adapter.interleaved_to_half(w_OI, head_dim=8)
    assert not torch.equal(half, w_OI)
    assert torch.equal(adapter.half_to_interleaved(half, head_dim=8), w_OI)
    # Head 0's pairs (rows 0,1), (2,3) become rows (0, 4), (1, 5).
    assert torch.equal(half[[0, 4, 1, 5]], w_OI[[0, 1, 2, 3]])


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_plait_export_loads_in_transformers_with_same_logits(tmp_path, tiny_args, tie_embeddings):
    args = dataclasses.replace(tiny_args, tie_embeddings=tie_embeddings)
    model = build_initialised(args)
    export(model, tmp_path, max_shard_size=40_000)  # several shards plus an index
    hf_model = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert hf_model.config.rope_parameters["rope_type"] == "llama3"

    tokens = torch.randint(0, args.vocab_size, (2, 48))  # past original_max_seq_len: scaling matters
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("tie_embeddings", [False, True])
def test_transformers_checkpoint_imports_with_same_logits(tmp_path, tie_embeddings):
    config = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=100,  # not what any multiple_of/multiplier flavor gives
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_theta=5000.0,
        tie_word_embeddings=tie_embeddings,
    )
    torch.manual_seed(0)
    hf_model = transformers.LlamaForCausalLM(config).eval()
    hf_model.save_pretrained(tmp_path)

    args = adapter.args_from_hf_config(json.loads((tmp_path / "config.json").read_text()))
    assert (args.ffn_hidden_dim, args.n_kv_heads, args.rope_theta) == (100, 2, 5000.0)
    model = Transformer(args)
    model.load_state_dict(adapter.from_hf(load_safetensors(tmp_path), args), strict=True)

    tokens = torch.randint(0, 96, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf_model(tokens).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", list(FLAVORS))
def test_config_round_trip(name):
    args = FLAVORS[name]
    config = adapter.hf_config(args)
    assert adapter.args_from_hf_config(config) == args
    # transformers reads it and derives the same sizes.
    hf_config = transformers.LlamaConfig(**config)
    assert (hf_config.intermediate_size, hf_config.head_dim) == (args.ffn_hidden_dim, args.head_dim)


def test_8B_config_is_the_published_one():
    config = adapter.hf_config(FLAVORS["8B"])
    assert config["intermediate_size"] == 14336
    assert config["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def test_reads_transformers_5_rope_parameters():
    config = adapter.hf_config(FLAVORS["1B"])
    rope_scaling = config.pop("rope_scaling")
    config["rope_parameters"] = rope_scaling | {"rope_theta": config.pop("rope_theta")}
    assert adapter.args_from_hf_config(config) == FLAVORS["1B"]


def test_rejects_what_plait_cannot_represent():
    config = adapter.hf_config(FLAVORS["debugmodel"])
    with pytest.raises(ValueError, match="attention_bias"):
        adapter.args_from_hf_config(config | {"attention_bias": True})
    with pytest.raises(KeyError):
        adapter.to_hf({"layers.0.attention.bias": torch.zeros(1)}, FLAVORS["debugmodel"])
