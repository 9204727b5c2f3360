"""Llama 3 <-> Hugging Face `LlamaForCausalLM` (see `plait.models.hf.adapter` for the interface).

Names map one to one (hf/common.py). The layouts differ in one place: plait's RoPE rotates adjacent
pairs, HF's rotates halves, so the rows of wq and wk are permuted within each head (hf/rotary.py).
"""

import dataclasses
import re

import torch

from plait.models.hf import common
from plait.models.hf.rotary import half_to_interleaved, interleaved_to_half
from plait.models.llama3.args import ModelArgs, RopeScaling
from plait.models.llama3.flavors import FLAVORS

HF_ARCHITECTURE = "LlamaForCausalLM"

_PER_LAYER = {**common.GQA_PROJECTIONS, **common.NORMS, **common.FEED_FORWARD}
_ROTARY = {"attention.wq.weight", "attention.wk.weight"}
# Non-persistent buffers some older HF checkpoints saved anyway.
_HF_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq|model\.rotary_emb\.inv_freq")


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    def layer(index: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if suffix not in _PER_LAYER:
            return None
        if suffix in _ROTARY:
            tensor = interleaved_to_half(tensor, args.head_dim)
        return {f"model.layers.{index}.{_PER_LAYER[suffix]}": tensor}

    return common.to_hf(state_dict, layer, tied=args.tie_embeddings)


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    per_layer = {hf: plait for plait, hf in _PER_LAYER.items()}

    def layer(index: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if suffix not in per_layer:
            return None
        if per_layer[suffix] in _ROTARY:
            tensor = half_to_interleaved(tensor, args.head_dim)
        return {f"layers.{index}.{per_layer[suffix]}": tensor}

    return common.from_hf(hf_state_dict, layer, tied=args.tie_embeddings, ignored=_HF_IGNORED)


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
    config = common.gqa_config(args, HF_ARCHITECTURE, "llama", args.ffn_hidden_dim, rope_scaling, mlp_bias=False)
    if args.vocab_size == FLAVORS["8B"].vocab_size:
        # The Llama 3 tokenizer's <|begin_of_text|> and <|end_of_text|>.
        config.update(bos_token_id=128000, eos_token_id=128001)
    return config


def _rope_from_hf(config: dict) -> tuple[float, RopeScaling | None]:
    rope, theta, rope_type = common.rope_config(config)
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
    common.check_representable("llama3", {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "mlp_bias": config.get("mlp_bias", False),
    })  # fmt: skip
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    if config.get("head_dim") not in (None, dim // n_heads):
        raise ValueError(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    rope_theta, rope_scaling = _rope_from_hf(config)
    args = ModelArgs(**common.gqa_args(config, max_seq_len=2048), rope_theta=rope_theta, rope_scaling=rope_scaling)
    return _with_ffn_hidden_dim(args, config["intermediate_size"])
