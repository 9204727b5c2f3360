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


MTP_ARGS = dataclasses.replace(ARGS, n_layers=2, vocab_size=256, mtp_layers=2)


def _mtp_model(args: ModelArgs) -> Transformer:
    model = _plait_model(args)
    with torch.no_grad():  # every norm and router bias non-trivial, so a swapped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.2)
        for mtp in model.mtp.values():
            mtp.block.moe.router.expert_bias.normal_(0, 0.1)
    return model


def _logits(model: Transformer, tokens_BT: torch.Tensor, depths: int):
    """Main logits and each MTP depth's, depth k reading the row shifted left by k."""
    S = tokens_BT.shape[1] - depths
    mtp_tokens_BKS = torch.stack([tokens_BT[:, k : k + S] for k in range(1, depths + 1)], 1)
    with torch.no_grad():
        main_BSV, *depth_logits = model(tokens_BT[:, :S], mtp_tokens=mtp_tokens_BKS)
    return [main_BSV, *depth_logits]


def test_mtp_depths_round_trip_in_the_release_naming(tmp_path):
    from plait.models.hf.convert import check_matches_model, from_hf, load_plait_state_dict
    from plait.models.hf.io import save_safetensors

    args, N = MTP_ARGS, MTP_ARGS.n_layers
    model = _mtp_model(args)
    hf_sd = adapter.to_hf(model.state_dict(), args)
    for k in range(args.mtp_layers):  # the released DeepSeek-V3 naming of depth k + 1
        layer = f"model.layers.{N + k}"
        for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                       "self_attn.kv_a_proj_with_mqa.weight", "mlp.gate.e_score_correction_bias",
                       "mlp.experts.7.down_proj.weight", "mlp.shared_experts.up_proj.weight"):
            assert f"{layer}.{suffix}" in hf_sd, suffix
        mtp = model.mtp[str(k)]
        for hf_suffix, ours in [("enorm.weight", mtp.enorm.weight), ("hnorm.weight", mtp.hnorm.weight),
                                ("eh_proj.weight", mtp.eh_proj.weight), ("shared_head.norm.weight", mtp.norm.weight),
                                ("self_attn.kv_a_proj_with_mqa.weight", mtp.block.attention.wkv_a.weight),
                                ("mlp.experts.7.down_proj.weight", mtp.block.moe.experts.w2[7].t())]:
            assert torch.equal(hf_sd[f"{layer}.{hf_suffix}"], ours), hf_suffix  # [dim, 2 * dim]: HF's layout too
        assert hf_sd[f"{layer}.embed_tokens.weight"] is hf_sd["model.embed_tokens.weight"]
        assert hf_sd[f"{layer}.shared_head.head.weight"] is hf_sd["lm_head.weight"]
    # A per-layer export converts subsets: one parameter at a time gives the same tensors.
    one_by_one = {k: v for name, t in model.state_dict().items() for k, v in adapter.to_hf({name: t}, args).items()}
    assert one_by_one.keys() == hf_sd.keys()

    # Written sharded with config.json and imported by `plait-convert from-hf` (num_nextn_predict_layers).
    save_safetensors(hf_sd, tmp_path / "hf", max_shard_size="200KB")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    from_hf("deepseek_v3", None, str(tmp_path / "hf"), str(tmp_path / "model.pt"), None)
    back = Transformer(args)
    back.load_state_dict(load_plait_state_dict(tmp_path / "model.pt"), strict=True)
    tokens_BT = torch.randint(0, args.vocab_size, (2, 16 + args.mtp_layers))
    for got, want in zip(_logits(back, tokens_BT, 2), _logits(model, tokens_BT, 2), strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)

    # A layer at a time (the trainer's import) gives the same plait tensors.
    layer_of = {name: name.split(".")[2] if name.startswith("model.layers.") else "" for name in hf_sd}
    by_layer = {}
    for layer in set(layer_of.values()):
        by_layer.update(adapter.from_hf({n: t for n, t in hf_sd.items() if layer_of[n] == layer}, args))
    assert by_layer.keys() == model.state_dict().keys()

    # Fewer depths than the checkpoint holds: the rest are dropped; more: one line naming a key.
    one = dataclasses.replace(args, mtp_layers=1)
    assert adapter.from_hf(hf_sd, one).keys() == Transformer(one).state_dict().keys()
    no_mtp = {n: t for n, t in hf_sd.items() if not n.startswith(f"model.layers.{N}.")}
    with pytest.raises(ValueError, match=r"does not match Transformer: missing mtp\.0\.\S+ \(and \d+ more\)\n"):
        check_matches_model(adapter.from_hf(no_mtp, one), Transformer, one)


def test_kimi_k2_release_naming_imports_with_identical_logits(tmp_path):
    """Kimi K2 ships DeepSeek-V3's architecture and weight names: its flavor's config survives the
    round trip, and a transformers model of its routing and YaRN at a tiny size imports exactly."""
    from plait.models.deepseek_v3 import FLAVORS
    from plait.models.hf.io import load_safetensors

    kimi = FLAVORS["kimi_k2"]
    assert adapter.args_from_hf_config(adapter.hf_config(kimi)) == kimi
    args = dataclasses.replace(kimi, vocab_size=128, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_heads=4,
                               n_routed_experts=8, n_activated_experts=2, q_lora_rank=32, kv_lora_rank=32,
                               qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=256,
                               original_seq_len=64)  # fmt: skip
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in adapter.hf_config(args).items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(2)
    hf = transformers.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "experts" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.1)
            elif "self_attn" in name and name.endswith("proj.weight"):
                p.mul_(5)
        for m in hf.modules():
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.1)
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    model = Transformer(args)
    model.load_state_dict(adapter.from_hf(load_safetensors(tmp_path), args), strict=True)
    tokens = torch.randint(0, args.vocab_size, (2, 80))  # past original_seq_len: YaRN's frequencies matter
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), hf(tokens).logits, atol=1e-5, rtol=1e-5)
