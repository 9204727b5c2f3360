"""Llama 3 <-> Hugging Face `LlamaForCausalLM` (see `plait.models.hf.adapter` for the interface).

Names map one to one. The layouts differ in one place: plait's RoPE rotates adjacent pairs
(x[2i], x[2i+1]) like Meta's reference, HF's rotates halves (x[i], x[i + head_dim/2]). Permuting
the output rows of wq and wk within each head turns one into the other: the attention scores are
unchanged because q and k are permuted alike and the score is a dot product over head_dim.
"""

import dataclasses
import re

import torch

from plait.models.llama3.args import ModelArgs, RopeScaling
from plait.models.llama3.flavors import FLAVORS

HF_ARCHITECTURE = "LlamaForCausalLM"

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
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROTARY = {"attention.wq.weight", "attention.wk.weight"}
_PLAIT_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Non-persistent buffers some older HF checkpoints saved anyway.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|model\.rotary_emb\.inv_freq")


def interleaved_to_half(w_OI: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from pairs (0, 1), (2, 3), ... to halves (0, 2, ..., 1, 3, ...)."""
    out_dim, in_dim = w_OI.shape
    return w_OI.view(out_dim // head_dim, head_dim // 2, 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def half_to_interleaved(w_OI: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of `interleaved_to_half`."""
    out_dim, in_dim = w_OI.shape
    return w_OI.view(out_dim // head_dim, 2, head_dim // 2, in_dim).transpose(1, 2).reshape(out_dim, in_dim)


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        if name == "output.weight" and args.tie_embeddings:
            continue  # HF stores a tied lm_head once, as the embedding
        if name in _TOP_LEVEL:
            hf_state_dict[_TOP_LEVEL[name]] = tensor
            continue
        match = _PLAIT_LAYER_KEY.fullmatch(name)
        if match is None or match.group(2) not in _PER_LAYER:
            raise KeyError(f"no HF name for plait parameter {name!r}")
        layer, suffix = match.groups()
        if suffix in _ROTARY:
            tensor = interleaved_to_half(tensor, args.head_dim)
        hf_state_dict[f"model.layers.{layer}.{_PER_LAYER[suffix]}"] = tensor
    return hf_state_dict


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    top_level = {hf: plait for plait, hf in _TOP_LEVEL.items()}
    per_layer = {hf: plait for plait, hf in _PER_LAYER.items()}
    state_dict = {}
    for name, tensor in hf_state_dict.items():
        if _HF_IGNORED.fullmatch(name):
            continue
        if name in top_level:
            state_dict[top_level[name]] = tensor
            continue
        match = _HF_LAYER_KEY.fullmatch(name)
        if match is None or match.group(2) not in per_layer:
            raise KeyError(f"no plait name for HF parameter {name!r}")
        layer, suffix = match.group(1), per_layer[match.group(2)]
        if suffix in _ROTARY:
            tensor = half_to_interleaved(tensor, args.head_dim)
        state_dict[f"layers.{layer}.{suffix}"] = tensor
    if args.tie_embeddings and "tok_embeddings.weight" in state_dict:
        # plait's state dict lists the shared matrix under both names. (A part of the folder, as a
        # layer-at-a-time load reads it, may hold other tensors alone.)
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def hf_config(args: ModelArgs) -> dict:
    """`config.json` for LlamaForCausalLM, in the format the published Llama 3.x checkpoints use
    (rope_theta + rope_scaling), which both transformers 4.x and 5.x read."""
    rope_scaling = None
    if args.rope_scaling is not None:
        rope_scaling = {
            "rope_type": "llama3",
            "factor": args.rope_scaling.factor,
            "low_freq_factor": args.rope_scaling.low_freq_factor,
            "high_freq_factor": args.rope_scaling.high_freq_factor,
            "original_max_position_embeddings": args.rope_scaling.original_max_seq_len,
        }
    config = {
        "architectures": [HF_ARCHITECTURE],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.n_kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": args.tie_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "use_cache": True,
    }
    if args.vocab_size == FLAVORS["8B"].vocab_size:
        # The Llama 3 tokenizer's <|begin_of_text|> and <|end_of_text|>.
        config.update(bos_token_id=128000, eos_token_id=128001)
    return config


def _rope_from_hf(config: dict) -> tuple[float, RopeScaling | None]:
    # transformers 5 writes {"rope_parameters": {"rope_type", "rope_theta", ...}}; older
    # configs have top-level rope_theta plus an optional rope_scaling dict.
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type != "llama3":
        raise ValueError(f"plait llama3 does not implement rope_type {rope_type!r}")
    scaling = RopeScaling(
        factor=float(rope["factor"]),
        low_freq_factor=float(rope["low_freq_factor"]),
        high_freq_factor=float(rope["high_freq_factor"]),
        original_max_seq_len=int(rope["original_max_position_embeddings"]),
    )
    return theta, scaling


def _with_ffn_hidden_dim(args: ModelArgs, hidden_dim: int) -> ModelArgs:
    """Choose (multiple_of, ffn_dim_multiplier) so that args.ffn_hidden_dim == hidden_dim."""
    candidates = [
        dataclasses.replace(args, multiple_of=flavor.multiple_of, ffn_dim_multiplier=flavor.ffn_dim_multiplier)
        for flavor in FLAVORS.values()
    ]
    # A published flavor comes back as itself (8B as multiple_of=1024, multiplier=1.3), then any
    # flavor's pair that gives the size.
    for candidate, flavor in zip(candidates, FLAVORS.values()):
        is_flavor = dataclasses.replace(candidate, max_seq_len=flavor.max_seq_len) == flavor
        if is_flavor and candidate.ffn_hidden_dim == hidden_dim:
            return candidate
    for candidate in candidates:
        if candidate.ffn_hidden_dim == hidden_dim:
            return candidate
    # Any size: the multiplier lands within one of hidden_dim, and rounding up to it hits it.
    base = int(2 * 4 * args.dim / 3)
    candidate = dataclasses.replace(args, multiple_of=hidden_dim, ffn_dim_multiplier=hidden_dim / base)
    if candidate.ffn_hidden_dim != hidden_dim:
        raise ValueError(f"cannot express intermediate_size {hidden_dim} for dim {args.dim}")
    return candidate


def args_from_hf_config(config: dict) -> ModelArgs:
    unsupported = {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
    }
    if any(unsupported.values()):
        raise ValueError(f"plait llama3 cannot represent this config: {[k for k, v in unsupported.items() if v]}")
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    rope_theta, rope_scaling = _rope_from_hf(config)
    args = ModelArgs(
        dim=dim,
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        max_seq_len=config.get("max_position_embeddings", 2048),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )
    return _with_ffn_hidden_dim(args, config["intermediate_size"])
