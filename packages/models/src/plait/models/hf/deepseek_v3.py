"""DeepSeek-V3 <-> Hugging Face `DeepseekV3ForCausalLM` (interface: `plait.models.hf.adapter`).

Layout differences:
- Routed experts: HF checkpoints hold one `nn.Linear` per expert (`mlp.experts.{j}.gate_proj`,
  `[hidden, dim]`); plait stacks them as `[E, in, out]`, so each is transposed. transformers 5
  fuses them in memory (`mlp.experts.gate_up_proj [E, 2*hidden, dim]`, `down_proj
  [E, dim, hidden]`); `from_hf` reads that form too, `to_hf` writes the checkpoint form.
- RoPE: DeepSeek rotates interleaved pairs like plait (`rope_interleave=True`, the default of
  every released checkpoint), so no rows move. A `rope_interleave=False` export is turned into
  the interleaved layout by permuting the rotary rows of the q and shared-k projections.
- Multi-token prediction: the release stores depth k as one more decoder layer,
  `model.layers.{num_hidden_layers + k}` (`num_nextn_predict_layers` of them), holding a whole
  decoder layer (-> `mtp.{k}.block`, converted like any layer: experts, FP8, rotary rows) plus
  `enorm`, `hnorm`, `eh_proj` (nn.Linear(2*dim, dim): `[dim, 2*dim]` applied to
  [enorm(emb); hnorm(h)], plait's order and layout), `shared_head.norm` (-> `mtp.{k}.norm`) and
  copies of the shared embedding and head (`embed_tokens`, `shared_head.head`). Import ignores
  the copies (plait shares `tok_embeddings` / `output`) and drops depths past `args.mtp_layers`
  (all of them when it is 0); export writes the copies wherever it writes the shared tensors, so a
  per-layer export (any subset of the state dict) still produces the release's naming.
- Rotary buffers (`rotary_emb.inv_freq`) are dropped.
HF's DeepseekV3 always scores experts with a sigmoid, so softmax-routed (V2-style) args cannot
be exported as this architecture.
"""

import re

import torch

from plait.models.deepseek_v3.args import ModelArgs
from plait.models.hf import common, experts
from plait.models.hf.rotary import half_to_interleaved

HF_ARCHITECTURE = "DeepseekV3ForCausalLM"

_PER_LAYER = {
    **common.NORMS,
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wq_a.weight": "self_attn.q_a_proj.weight",
    "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
    "attention.wq_b.weight": "self_attn.q_b_proj.weight",
    "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
    "attention.wkv_b.weight": "self_attn.kv_b_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    **common.FEED_FORWARD,
    **common.ROUTER_GATE,
    "moe.router.expert_bias": "mlp.gate.e_score_correction_bias",
    "moe.shared_experts.w1.weight": "mlp.shared_experts.gate_proj.weight",
    "moe.shared_experts.w2.weight": "mlp.shared_experts.down_proj.weight",
    "moe.shared_experts.w3.weight": "mlp.shared_experts.up_proj.weight",
}
# What an MTP depth adds to its decoder layer (plait suffix under mtp.{k} -> HF under model.layers.{N + k}).
_MTP_OWN = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "norm.weight": "shared_head.norm.weight",
}
# The release repeats the shared embedding and head in each MTP layer: plait name -> copy's suffix.
_MTP_COPIES = {"tok_embeddings.weight": "embed_tokens.weight", "output.weight": "shared_head.head.weight"}
_PLAIT_MTP_KEY = re.compile(r"mtp\.(\d+)\.(.+)")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """plait -> HF names and layouts; works on any subset of the state dict (per-layer export)."""
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        if name in common.TOP_LEVEL:
            hf_state_dict[common.TOP_LEVEL[name]] = tensor
            for k in range(args.mtp_layers) if name in _MTP_COPIES else ():
                hf_state_dict[f"model.layers.{args.n_layers + k}.{_MTP_COPIES[name]}"] = tensor
            continue
        if (mtp := _PLAIT_MTP_KEY.fullmatch(name)) and mtp.group(2) in _MTP_OWN:  # enorm, hnorm, eh_proj, norm
            hf_state_dict[f"model.layers.{args.n_layers + int(mtp.group(1))}.{_MTP_OWN[mtp.group(2)]}"] = tensor
            continue
        layer, suffix = _hf_layer_of(name, args)
        prefix = f"model.layers.{layer}"
        if suffix in _PER_LAYER:
            hf_state_dict[f"{prefix}.{_PER_LAYER[suffix]}"] = tensor
        elif suffix in experts.PROJECTIONS:  # [E, in, out] -> E x nn.Linear weight [out, in]
            hf_state_dict.update(experts.to_hf(prefix, suffix, tensor))
        else:
            raise KeyError(f"no HF name for plait parameter {name!r}")
    return hf_state_dict


def _hf_layer_of(name: str, args: ModelArgs) -> tuple[int, str]:
    """The HF layer index of a block parameter (`layers.{i}.*`, or MTP depth k's `mtp.{k}.block.*`:
    layer n_layers + k) and its suffix inside the block."""
    if match := common.PLAIT_LAYER_KEY.fullmatch(name):
        return int(match.group(1)), match.group(2)
    if (match := _PLAIT_MTP_KEY.fullmatch(name)) and match.group(2).startswith("block."):
        return args.n_layers + int(match.group(1)), match.group(2).removeprefix("block.")
    raise KeyError(f"no HF name for plait parameter {name!r}")


def _rope_rows_to_interleaved(w_OI: torch.Tensor, args: ModelArgs, per_head: bool) -> torch.Tensor:
    """Permute the rotary rows of a q (per head) or wkv_a (one shared key) weight to pairs."""
    R = args.qk_rope_head_dim
    if per_head:
        w_HQI = w_OI.view(-1, args.qk_head_dim, w_OI.shape[1])
        nope, rope = w_HQI.split([args.qk_nope_head_dim, R], dim=1)
        rope = half_to_interleaved(rope.reshape(-1, w_OI.shape[1]), R).view_as(rope)
        return torch.cat([nope, rope], dim=1).reshape_as(w_OI)
    latent, rope = w_OI.split([args.kv_lora_rank, R], dim=0)
    return torch.cat([latent, half_to_interleaved(rope, R)], dim=0)


def _plait_prefix(layer: int, suffix: str, args: ModelArgs) -> str | None:
    """The plait prefix HF layer `layer` (entry `suffix`) converts under: `layers.{i}`, an MTP
    depth's `mtp.{k}.block` / `mtp.{k}`, or None for what import drops (MTP depths past
    `args.mtp_layers`, and the MTP layers' copies of the shared embedding and head)."""
    if layer < args.n_layers:
        return f"layers.{layer}"
    k = layer - args.n_layers
    if k >= args.mtp_layers or suffix in _MTP_COPIES.values():
        return None
    return f"mtp.{k}" if suffix in _MTP_OWN.values() else f"mtp.{k}.block"


def from_hf(
    hf_state_dict: dict[str, torch.Tensor], args: ModelArgs, *, rope_interleave: bool = True
) -> dict[str, torch.Tensor]:
    """HF names/layouts -> plait. `rope_interleave=False` for exports made with that HF flag.
    Works on any subset holding whole layers (the trainer imports a layer at a time)."""
    per_layer = {hf: plait for plait, hf in _PER_LAYER.items()}
    mtp_own = {hf: plait for plait, hf in _MTP_OWN.items()}
    routed = experts.ExpertCollector(args.n_routed_experts)

    def layer(index: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = _plait_prefix(int(index), suffix, args)
        if prefix is None:
            return {}
        if suffix in mtp_own and not prefix.startswith("layers."):  # enorm, hnorm, eh_proj, norm
            return {f"{prefix}.{mtp_own[suffix]}": tensor}
        if suffix in per_layer:
            plait_suffix = per_layer[suffix]
            if not rope_interleave and plait_suffix in ("attention.wq.weight", "attention.wq_b.weight"):
                tensor = _rope_rows_to_interleaved(tensor, args, per_head=True)
            elif not rope_interleave and plait_suffix == "attention.wkv_a.weight":
                tensor = _rope_rows_to_interleaved(tensor, args, per_head=False)
            return {f"{prefix}.{plait_suffix}": tensor}
        if experts.is_hf_expert(suffix):  # per expert, or transformers 5's fused form
            routed.add(prefix, suffix, tensor)
            return {}
        return None

    return common.from_hf(hf_state_dict, layer, routed=routed)


def hf_config(args: ModelArgs) -> dict:
    """`config.json` for DeepseekV3ForCausalLM in the released checkpoints' format (rope_theta +
    rope_scaling), which transformers 4.x and 5.x both read."""
    if args.score_func != "sigmoid":
        raise ValueError(f"Hugging Face's DeepseekV3 scores experts with a sigmoid and this model routes with "
                         f"{args.score_func} (the debugmodel, 16B and 236B flavors' V2-style routing), which it cannot "
                         "load: train with --model.score_func sigmoid to export to Hugging Face, or keep plait's own "
                         "checkpoint (it reshards and resumes on any layout)")  # fmt: skip
    rope_scaling = None
    if args.uses_yarn:
        rope_scaling = {
            "type": "yarn",
            "rope_type": "yarn",
            "factor": args.rope_factor,
            "original_max_position_embeddings": args.original_seq_len,
            "beta_fast": args.beta_fast,
            "beta_slow": args.beta_slow,
            # Equal mscales: HF's cos/sin factor is 1 and the softmax scale gets mscale^2, as here.
            "mscale": args.mscale,
            "mscale_all_dim": args.mscale,
        }
    return {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "deepseek_v3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "moe_intermediate_size": args.moe_inter_dim,
        "num_hidden_layers": args.n_layers,
        "first_k_dense_replace": args.n_dense_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_heads,
        "n_routed_experts": args.n_routed_experts,
        "n_shared_experts": args.n_shared_experts,
        "num_experts_per_tok": args.n_activated_experts,
        "n_group": args.n_expert_groups,
        "topk_group": args.n_limited_groups,
        "norm_topk_prob": args.route_norm,
        "routed_scaling_factor": args.route_scale,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "q_lora_rank": args.q_lora_rank or None,
        "kv_lora_rank": args.kv_lora_rank,
        "qk_nope_head_dim": args.qk_nope_head_dim,
        "qk_rope_head_dim": args.qk_rope_head_dim,
        "v_head_dim": args.v_head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_interleave": True,
        "num_nextn_predict_layers": args.mtp_layers,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def args_from_hf_config(config: dict) -> ModelArgs:
    common.check_representable("deepseek_v3", {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "scoring_func": config.get("scoring_func", "sigmoid") != "sigmoid",
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
        "num_key_value_heads": config.get("num_key_value_heads") not in (None, config["num_attention_heads"]),
        # The adapter functions see no config, so a half-split rotary layout must be converted
        # explicitly with from_hf(..., rope_interleave=False).
        "rope_interleave": config.get("rope_interleave", True) is False,
    })  # fmt: skip
    rope, theta, rope_type = common.rope_config(config)
    max_seq_len = config.get("max_position_embeddings", 4096)
    yarn = {}
    if rope_type == "yarn":
        mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if not mscale_all_dim or (mscale and mscale != mscale_all_dim) or rope.get("attention_factor"):
            raise ValueError("plait implements YaRN with mscale == mscale_all_dim (released DeepSeek configs)")
        yarn = dict(
            rope_factor=float(rope["factor"]),
            original_seq_len=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast") or 32),
            beta_slow=float(rope.get("beta_slow") or 1),
            mscale=float(mscale_all_dim),
        )
        if max_seq_len <= yarn["original_seq_len"]:
            raise ValueError("YaRN with max_position_embeddings <= original: plait applies YaRN only beyond it")
    else:
        yarn = dict(rope_factor=1.0)
    return ModelArgs(
        vocab_size=config["vocab_size"],
        dim=config["hidden_size"],
        inter_dim=config["intermediate_size"],
        moe_inter_dim=config["moe_intermediate_size"],
        n_layers=config["num_hidden_layers"],
        n_dense_layers=config.get("first_k_dense_replace", 0),
        n_heads=config["num_attention_heads"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        n_routed_experts=config["n_routed_experts"],
        n_shared_experts=config.get("n_shared_experts") or 0,
        n_activated_experts=config["num_experts_per_tok"],
        score_func="sigmoid",
        route_norm=bool(config.get("norm_topk_prob", False)),
        route_scale=float(config.get("routed_scaling_factor", 1.0)),
        n_expert_groups=config.get("n_group") or 1,
        n_limited_groups=config.get("topk_group") or 1,
        q_lora_rank=config.get("q_lora_rank") or 0,
        kv_lora_rank=config["kv_lora_rank"],
        qk_nope_head_dim=config["qk_nope_head_dim"],
        qk_rope_head_dim=config["qk_rope_head_dim"],
        v_head_dim=config["v_head_dim"],
        max_seq_len=max_seq_len,
        rope_theta=theta,
        # The checkpoint's MTP depths; a run may train fewer (import drops the rest: from_hf).
        mtp_layers=int(config.get("num_nextn_predict_layers") or 0),
        **yarn,
    )
