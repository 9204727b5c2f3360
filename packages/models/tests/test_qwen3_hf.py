"""Qwen3 <-> transformers' Qwen3ForCausalLM and Qwen3MoeForCausalLM (tiny configs built here, fp32):
the same logits both ways, exports that round-trip, and training steps that match transformers' own."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F

from plait.models.hf import qwen3 as adapter
from plait.models.hf.convert import check_matches_model
from plait.models.hf.io import load_safetensors, save_safetensors
from plait.models.qwen3 import FLAVORS, Transformer

transformers = pytest.importorskip("transformers")

VOCAB = 96


def _hf_model(moe: bool, tie: bool = False, seed: int = 0):
    """A random transformers model whose every weight matters: norms away from 1, experts and router
    away from HF's init, projections scaled so attention is sharp (a wrong rotary layout shows)."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=64, rms_norm_eps=1e-6,
                  rope_theta=10000.0, tie_word_embeddings=tie)  # fmt: skip
    if moe:
        config = transformers.Qwen3MoeConfig(**common, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                             norm_topk_prob=True, router_aux_loss_coef=0.0)  # fmt: skip
        cls = transformers.Qwen3MoeForCausalLM
    else:
        config, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    torch.manual_seed(seed)
    hf = cls(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.1)
            elif "self_attn" in name:
                p.mul_(3)
    return hf


def _plait_from(folder) -> Transformer:
    args = adapter.args_from_hf_config(json.loads((folder / "config.json").read_text()))
    state_dict = adapter.from_hf(load_safetensors(folder), args)
    check_matches_model(state_dict, Transformer, args)
    model = Transformer(args)
    model.load_state_dict(state_dict, strict=True)
    return model


CASES = [(False, False), (False, True), (True, False)]
IDS = ["dense", "dense-tied", "moe"]


@pytest.mark.parametrize("moe, tie", CASES, ids=IDS)
def test_transformers_checkpoint_imports_with_identical_logits_and_exports_back(tmp_path, moe, tie):
    hf = _hf_model(moe, tie)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    model = _plait_from(tmp_path / "hf")
    assert (model.args.is_moe, model.args.tie_embeddings, model.args.head_dim) == (moe, tie, 32)
    tokens = torch.randint(0, VOCAB, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
        # transformers 5's in-memory layout (fused experts) imports too.
        in_memory = Transformer(model.args)
        in_memory.load_state_dict(adapter.from_hf(hf.state_dict(), model.args), strict=True)
        torch.testing.assert_close(in_memory(tokens), expected, atol=1e-5, rtol=1e-5)

    # Export: plait -> files transformers loads, same logits; and the files import to the same tensors.
    save_safetensors(adapter.to_hf(model.state_dict(), model.args), tmp_path / "out", max_shard_size="100KB")
    (tmp_path / "out" / "config.json").write_text(json.dumps(adapter.hf_config(model.args)))
    reloaded = type(hf).from_pretrained(tmp_path / "out", dtype=torch.float32).eval()
    back = _plait_from(tmp_path / "out")
    assert back.args == model.args
    with torch.no_grad():
        torch.testing.assert_close(reloaded(tokens).logits, expected, atol=1e-5, rtol=1e-5)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def _loss(logits_BSV: torch.Tensor, tokens_BS: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV[:, :-1].flatten(0, 1), tokens_BS[:, 1:].flatten())


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("moe, tie", CASES, ids=IDS)
def test_training_steps_match_transformers(moe, tie, optimizer):
    """Three steps from the same weights on the same batches: every loss agrees, and so does every
    parameter's update (SGD: 1e-5 relative; AdamW moves an entry whose gradient is ~0 by up to lr
    either way, so a few entries may differ by 1e-4 at lr 1e-2: 1e-3 of the parameter's update)."""
    hf = _hf_model(moe, tie).train()
    args = adapter.args_from_hf_config(hf.config.to_dict() | {"architectures": [type(hf).__name__]})
    model = Transformer(args).train()
    model.load_state_dict(adapter.from_hf(hf.state_dict(), args), strict=True)
    initial = {name: t.clone() for name, t in model.state_dict().items()}

    def make(params):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    ours, theirs = make(model.parameters()), make(hf.parameters())
    torch.manual_seed(1)
    for _ in range(3):
        tokens = torch.randint(0, VOCAB, (2, 24))
        losses = []
        for opt, logits in ((ours, lambda t: model(t)), (theirs, lambda t: hf(t).logits)):
            opt.zero_grad()
            loss = _loss(logits(tokens), tokens)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-5, abs=1e-6)
    trained = adapter.from_hf({k: v.detach() for k, v in hf.state_dict().items()}, args)
    for name, tensor in model.state_dict().items():
        update = (trained[name] - initial[name]).norm()
        assert (tensor - trained[name]).norm() <= (1e-5 if optimizer == "sgd" else 1e-3) * update + 1e-7, name
        assert update > 0 or name.endswith("expert_bias"), name  # every weight trained


def test_layer_at_a_time_and_one_tensor_at_a_time_give_the_whole_conversion():
    hf_sd = adapter.to_hf(Transformer(FLAVORS["debugmodel_moe"]).state_dict(), FLAVORS["debugmodel_moe"])
    args = FLAVORS["debugmodel_moe"]
    assert "model.layers.5.mlp.experts.7.down_proj.weight" in hf_sd and "model.layers.0.mlp.gate.weight" in hf_sd
    layer_of = {name: name.split(".")[2] if name.startswith("model.layers.") else "" for name in hf_sd}
    by_layer = {}
    for layer in set(layer_of.values()):
        by_layer.update(adapter.from_hf({n: t for n, t in hf_sd.items() if layer_of[n] == layer}, args))
    assert by_layer.keys() == Transformer(args).state_dict().keys()
    one_by_one = {k for name, t in Transformer(args).state_dict().items() for k in adapter.to_hf({name: t}, args)}
    assert one_by_one == hf_sd.keys()


def test_what_hugging_face_cannot_hold_is_refused_in_one_line():
    args = FLAVORS["debugmodel_moe"]
    model = Transformer(args)
    with torch.no_grad():
        model.layers["1"].moe.router.expert_bias[0] = 0.5
    with pytest.raises(ValueError, match=r"^layers\.1\.moe\.router\.expert_bias is not zero .*load_balance_coeff[^\n]*$"):
        adapter.to_hf(model.state_dict(), args)
    with pytest.raises(ValueError, match=r"^Hugging Face's Qwen3-MoE routes without a selection bias .*load_balance_coeff 0"):
        adapter.hf_config(dataclasses.replace(args, load_balance_coeff=1e-3))  # refused before a run trains it
    config = adapter.hf_config(args)
    for change, field in [({"use_sliding_window": True}, "use_sliding_window"), ({"mlp_only_layers": [0]}, "mlp_only_layers"),
                          ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
                          ({"attention_bias": True}, "attention_bias")]:  # fmt: skip
        with pytest.raises(ValueError, match=f"cannot represent this config: \\['{field}'\\]"):
            adapter.args_from_hf_config(config | change)
    with pytest.raises(KeyError, match="no HF name"):
        adapter.to_hf({"layers.0.attention.bias": torch.zeros(1)}, args)
    with pytest.raises(KeyError, match="no plait name"):
        adapter.from_hf({"model.layers.0.mlp.shared_expert.up_proj.weight": torch.zeros(1)}, args)


@pytest.mark.parametrize("name", list(FLAVORS))
def test_config_round_trip_and_transformers_reads_it(name):
    args = FLAVORS[name]
    config = adapter.hf_config(args)
    assert adapter.args_from_hf_config(config) == args
    cls = transformers.Qwen3MoeConfig if args.is_moe else transformers.Qwen3Config
    hf_config = cls(**{k: v for k, v in config.items() if k not in ("architectures", "model_type")})
    assert (hf_config.head_dim, hf_config.num_key_value_heads, hf_config.tie_word_embeddings) == (
        args.head_dim, args.n_kv_heads, args.tie_embeddings)
