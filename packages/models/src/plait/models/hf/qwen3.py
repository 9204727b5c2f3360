"""Qwen3 <-> Hugging Face `Qwen3ForCausalLM` (dense) and `Qwen3MoeForCausalLM` (interface:
`plait.models.hf.adapter`). One plait model, two HF architectures: `n_routed_experts > 0` is the MoE one.

Layout differences:
- RoPE: plait rotates adjacent pairs, HF halves (as for Llama 3, hf/llama3.py): the rows of wq and
  wk are permuted within each head, and so are the per-head `q_norm` / `k_norm` weights, which
  scale the head's entries before the rotation.
- Routed experts: one `nn.Linear` per expert in the released checkpoints, fused in transformers 5's
  memory, stacked `[E, in, out]` in plait (hf/experts.py, shared with DeepSeek-V3).
- The router's `expert_bias` (plait's auxiliary-loss-free balancing) has no HF counterpart:
  import gives zeros, export drops a zero bias and refuses any other (HF would route differently).
- A tied head is stored once, as the embedding.
"""

import re

import torch

from plait.models.hf import experts
from plait.models.hf.llama3 import half_to_interleaved, interleaved_to_half
from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.flavors import QWEN3_VOCAB_SIZE

HF_ARCHITECTURE = "Qwen3ForCausalLM"
HF_MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
# Every architecture this adapter reads (plait.checkpoint matches a folder's against them).
HF_ARCHITECTURES = (HF_ARCHITECTURE, HF_MOE_ARCHITECTURE)

_TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_PER_LAYER = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "moe.router.gate.weight": "mlp.gate.weight",
}
# Rows (or norm weights) laid out per head in RoPE's pair order.
_ROTARY = {"attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight"}
_EXPERT_BIAS = "moe.router.expert_bias"
_PLAIT_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
_HF_IGNORED = re.compile(r".*rotary_emb\.inv_freq")


def _rotary(tensor: torch.Tensor, head_dim: int, to_hf: bool) -> torch.Tensor:
    """A projection's rows (or a [head_dim] norm weight, as one row per entry) between the layouts."""
    permute = interleaved_to_half if to_hf else half_to_interleaved
    if tensor.dim() == 1:
        return permute(tensor[:, None], head_dim)[:, 0]
    return permute(tensor, head_dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """plait -> HF names and layouts; works on any subset of the state dict (per-layer export)."""
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_embeddings:
            continue  # HF stores a tied lm_head once, as the embedding
        if name in _TOP_LEVEL:
            hf_state_dict[_TOP_LEVEL[name]] = tensor
            continue
        match = _PLAIT_LAYER_KEY.fullmatch(name)
        if match is None:
            raise KeyError(f"no HF name for plait parameter {name!r}")
        layer, suffix = match.groups()
        prefix = f"model.layers.{layer}"
        if suffix == _EXPERT_BIAS:
            _check_no_bias(name, tensor)
        elif suffix in _PER_LAYER:
            hf_state_dict[f"{prefix}.{_PER_LAYER[suffix]}"] = _rotary(tensor, args.head_dim, True) if suffix in _ROTARY else tensor
        elif suffix in experts.PROJECTIONS:  # [E, in, out] -> E x nn.Linear weight [out, in]
            hf_state_dict.update(experts.to_hf(prefix, suffix, tensor))
        else:
            raise KeyError(f"no HF name for plait parameter {name!r}")
    return hf_state_dict


def _check_no_bias(name: str, bias_E: torch.Tensor) -> None:
    if not bias_E.is_meta and bool(bias_E.any()):
        raise ValueError(f"{name} is not zero (trained with model.load_balance_coeff > 0): Hugging Face's Qwen3-MoE "
                         "routes without a selection bias, so the export would pick other experts; balance with "
                         "model.aux_loss_coeff instead (load_balance_coeff = 0), or keep plait's own checkpoint")


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names/layouts -> plait; works on any subset holding whole layers (a layer-at-a-time import)."""
    top_level = {hf: plait for plait, hf in _TOP_LEVEL.items()}
    per_layer = {hf: plait for plait, hf in _PER_LAYER.items()}
    state_dict: dict[str, torch.Tensor] = {}
    routed = experts.ExpertCollector(args.n_routed_experts)
    for name, tensor in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        if name in top_level:
            state_dict[top_level[name]] = tensor
            continue
        match = _HF_LAYER_KEY.fullmatch(name)
        if match is None:
            raise KeyError(f"no plait name for HF parameter {name!r}")
        prefix, suffix = f"layers.{match.group(1)}", match.group(2)
        if suffix in per_layer:
            plait_suffix = per_layer[suffix]
            rotary = plait_suffix in _ROTARY
            state_dict[f"{prefix}.{plait_suffix}"] = _rotary(tensor, args.head_dim, False) if rotary else tensor
            if plait_suffix == "moe.router.gate.weight":  # [E, dim]: the bias HF has not
                state_dict[f"{prefix}.{_EXPERT_BIAS}"] = torch.zeros(tensor.shape[0], dtype=torch.float32)
        elif experts.is_hf_expert(suffix):  # per expert, or transformers 5's fused form
            routed.add(prefix, suffix, tensor)
        else:
            raise KeyError(f"no plait name for HF parameter {name!r}")
    state_dict.update(routed.result())
    if args.tie_embeddings and "tok_embeddings.weight" in state_dict:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]  # plait lists it under both names
    return state_dict


def hf_config(args: ModelArgs) -> dict:
    """`config.json` for Qwen3ForCausalLM, or Qwen3MoeForCausalLM when the model routes experts, in
    the released checkpoints' format (rope_theta at the top), which transformers 4.5x and 5.x read."""
    if args.is_moe and args.load_balance_coeff > 0:
        raise ValueError(f"Hugging Face's Qwen3-MoE routes without a selection bias and this model balances its experts "
                         f"with one (load_balance_coeff = {args.load_balance_coeff}), so an export would pick other experts: "
                         "train with --model.load_balance_coeff 0 (balance with model.aux_loss_coeff) to export to Hugging "
                         "Face, or keep plait's own checkpoint")  # fmt: skip
    config = {
        "architectures": [HF_MOE_ARCHITECTURE if args.is_moe else HF_ARCHITECTURE],
        "model_type": "qwen3_moe" if args.is_moe else "qwen3",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.inter_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if args.is_moe:
        config.update(
            num_experts=args.n_routed_experts,
            num_experts_per_tok=args.n_activated_experts,
            moe_intermediate_size=args.moe_inter_dim,
            norm_topk_prob=args.route_norm,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=args.aux_loss_coeff,
        )
    if args.vocab_size == QWEN3_VOCAB_SIZE:
        # The Qwen tokenizer's <|endoftext|> (the base models' bos and eos).
        config.update(bos_token_id=151643, eos_token_id=151643)
    return config


def args_from_hf_config(config: dict) -> ModelArgs:
    architecture = (config.get("architectures") or [None])[0]
    moe = config.get("model_type") == "qwen3_moe" or architecture == HF_MOE_ARCHITECTURE
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "use_sliding_window": config.get("use_sliding_window", False),
        "rope_scaling": rope.get("rope_type", rope.get("type", "default")) != "default",
        # plait's MoE blocks are all MoE: no dense block among them.
        "mlp_only_layers": moe and bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": moe and config.get("decoder_sparse_step", 1) != 1,
    }
    if any(unsupported.values()):
        raise ValueError(f"plait qwen3 cannot represent this config: {[k for k, v in unsupported.items() if v]}")
    n_heads = config["num_attention_heads"]
    moe_args = dict(
        # "num_local_experts" is the name transformers 5's to_dict writes.
        n_routed_experts=config.get("num_experts") or config["num_local_experts"],
        n_activated_experts=config["num_experts_per_tok"],
        moe_inter_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)),
    ) if moe else {}  # fmt: skip
    return ModelArgs(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // n_heads,
        vocab_size=config["vocab_size"],
        inter_dim=config["intermediate_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=float(config.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_seq_len=config.get("max_position_embeddings", 40960),
        tie_embeddings=config.get("tie_word_embeddings", False),
        **moe_args,
    )
