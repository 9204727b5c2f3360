"""DeepSeek-V3 <-> transformers' DeepseekV3ForCausalLM: same logits both ways, from real files."""

import dataclasses
import json

import pytest
import torch

from plait.models.deepseek_v3 import ModelArgs, Transformer
from plait.models.hf import deepseek_v3 as adapter

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

ARGS = ModelArgs(
    vocab_size=128,
    dim=64,
    inter_dim=128,
    moe_inter_dim=32,
    n_layers=3,
    n_dense_layers=1,
    n_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    n_activated_experts=2,
    score_func="sigmoid",
    route_norm=True,
    route_scale=2.5,
    n_expert_groups=4,
    n_limited_groups=2,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_seq_len=256,
    original_seq_len=64,
    rope_factor=4.0,
    mscale=0.707,
    norm_eps=1e-6,
)


def _plait_model(args: ModelArgs) -> Transformer:
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    with torch.no_grad():  # a non-zero bias exercises e_score_correction_bias
        for layer in model.layers.values():
            if layer.is_moe:
                layer.moe.router.expert_bias.normal_(0, 0.1)
    return model


def _hf_from_dir(path):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(
        path, attn_implementation="eager", dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("q_lora_rank,yarn", [(32, True), (0, False)])
def test_plait_to_hf_and_back(tmp_path, q_lora_rank, yarn):
    args = dataclasses.replace(ARGS, q_lora_rank=q_lora_rank, rope_factor=4.0 if yarn else 1.0)
    model = _plait_model(args)
    (tmp_path / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    hf_state_dict = adapter.to_hf(model.state_dict(), args)
    assert "model.layers.1.mlp.experts.7.down_proj.weight" in hf_state_dict  # checkpoint layout
    safetensors_torch.save_file(
        {k: v.contiguous() for k, v in hf_state_dict.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"}
    )
    hf = _hf_from_dir(tmp_path)

    tokens = torch.randint(0, args.vocab_size, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)

    # Back: HF's own save (its on-disk layout) and its in-memory (fused experts) state dict.
    hf.save_pretrained(tmp_path / "resaved")
    config = json.loads((tmp_path / "resaved" / "config.json").read_text())
    args_back = adapter.args_from_hf_config(config)
    if not yarn:  # YaRN-only fields have nothing to round-trip through
        args_back = dataclasses.replace(args_back, original_seq_len=args.original_seq_len, mscale=args.mscale)
    assert args_back == args
    for hf_sd in (safetensors_torch.load_file(tmp_path / "resaved" / "model.safetensors"), hf.state_dict()):
        back = Transformer(args_back)
        back.load_state_dict(adapter.from_hf(hf_sd, args_back), strict=True)
        with torch.no_grad():
            torch.testing.assert_close(back(tokens), expected, atol=1e-5, rtol=1e-5)


def test_hf_random_model_to_plait_including_half_split_rope(tmp_path):
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in adapter.hf_config(ARGS).items() if k not in ("architectures", "model_type")}
    )
    for rope_interleave in (True, False):
        config.rope_interleave = rope_interleave
        torch.manual_seed(1)
        hf = transformers.DeepseekV3ForCausalLM(config).eval()
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if "experts" in name or name.endswith("gate.weight"):
                    p.normal_(0, 0.1)  # HF zero/normal-inits some of these; make them all count
                elif "self_attn" in name and name.endswith("proj.weight"):
                    p.mul_(5)  # sharp attention, so a wrong rotary layout shows in the logits
            for m in hf.modules():
                if hasattr(m, "e_score_correction_bias"):
                    m.e_score_correction_bias.normal_(0, 0.1)
        model = Transformer(ARGS)
        model.load_state_dict(adapter.from_hf(hf.state_dict(), ARGS, rope_interleave=rope_interleave), strict=True)
        tokens = torch.randint(0, ARGS.vocab_size, (2, 20))
        with torch.no_grad():
            torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)


def test_unrepresentable_configs_are_refused():
    with pytest.raises(ValueError, match="sigmoid"):
        adapter.hf_config(dataclasses.replace(ARGS, score_func="softmax"))
    config = adapter.hf_config(ARGS)
    with pytest.raises(ValueError, match="rope_interleave"):
        adapter.args_from_hf_config({**config, "rope_interleave": False})
    with pytest.raises(ValueError, match="mscale"):
        adapter.args_from_hf_config({**config, "rope_scaling": {**config["rope_scaling"], "mscale_all_dim": 1.0}})


def test_mtp_layers_and_rotary_buffers_are_dropped():
    model = _plait_model(ARGS)
    hf_sd = adapter.to_hf(model.state_dict(), ARGS)
    hf_sd["model.layers.3.eh_proj.weight"] = torch.zeros(1)  # an MTP layer beyond n_layers
    hf_sd["model.rotary_emb.inv_freq"] = torch.zeros(1)
    assert set(adapter.from_hf(hf_sd, ARGS)) == set(model.state_dict())
