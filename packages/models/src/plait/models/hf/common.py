"""What the Hugging Face adapters share: the names that map alike in every model, the walk over a
state dict that hands each decoder layer's entries to the adapter, and config.json's common parts.

The walks keep the order of the state dict they are given (a layer-at-a-time conversion, and the
order the files are written in, depend on it).
"""

import re
from collections.abc import Callable

import torch

from plait.models.hf.experts import ExpertCollector

# plait name -> HF name, outside the layers.
TOP_LEVEL = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Inside a layer (plait `layers.{i}.` -> HF `model.layers.{i}.`): the block's two norms, the dense
# SwiGLU, grouped-query attention's projections and an MoE's router.
NORMS = {"attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
FEED_FORWARD = {
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
GQA_PROJECTIONS = {
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
}
ROUTER_GATE = {"moe.router.gate.weight": "mlp.gate.weight"}
PLAIT_LAYER_KEY = re.compile(r"layers\.(\d+)\.(.+)")
HF_LAYER_KEY = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Non-persistent buffers some HF checkpoints saved anyway.
ROTARY_BUFFERS = re.compile(r".*rotary_emb\.inv_freq")

# (layer index, suffix inside the layer, tensor) -> the entries it becomes ({}: consumed, or
# dropped), or None for a suffix the adapter does not know (the walk raises KeyError naming it).
LayerConverter = Callable[[str, str, torch.Tensor], dict[str, torch.Tensor] | None]


def to_hf(state_dict: dict[str, torch.Tensor], convert_layer: LayerConverter, *, tied: bool = False) -> dict[str, torch.Tensor]:
    """plait -> HF: TOP_LEVEL names, and each `layers.{i}.{suffix}` through `convert_layer`. A tied
    head is left out (HF stores it once, as the embedding)."""
    kept = {name: tensor for name, tensor in state_dict.items() if not (tied and name == "output.weight")}
    return _convert(kept, TOP_LEVEL, PLAIT_LAYER_KEY, convert_layer, "no HF name for plait parameter {!r}")


def from_hf(
    hf_state_dict: dict[str, torch.Tensor],
    convert_layer: LayerConverter,
    *,
    routed: ExpertCollector | None = None,
    tied: bool = False,
    ignored: re.Pattern = ROTARY_BUFFERS,
) -> dict[str, torch.Tensor]:
    """HF -> plait: `ignored` names dropped, TOP_LEVEL names mapped back, each
    `model.layers.{i}.{suffix}` through `convert_layer`; then the experts `routed` gathered, stacked,
    and a tied head listed under both names as plait's state dict has it (only where the embedding
    is among the tensors: a layer-at-a-time import may hold other tensors alone)."""
    kept = {name: tensor for name, tensor in hf_state_dict.items() if not ignored.fullmatch(name)}
    top_level = {hf: plait for plait, hf in TOP_LEVEL.items()}
    state_dict = _convert(kept, top_level, HF_LAYER_KEY, convert_layer, "no plait name for HF parameter {!r}")
    if routed is not None:
        state_dict.update(routed.result())
    if tied and "tok_embeddings.weight" in state_dict:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def _convert(tensors: dict[str, torch.Tensor], top_level: dict[str, str], layer_key: re.Pattern,
             convert_layer: LayerConverter, unknown: str) -> dict[str, torch.Tensor]:
    """Each name renamed by `top_level`, or split by `layer_key` into (layer index, suffix) for
    `convert_layer`; any other name raises KeyError(`unknown` naming it)."""
    converted: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name in top_level:
            converted[top_level[name]] = tensor
            continue
        match = layer_key.fullmatch(name)
        entries = None if match is None else convert_layer(match.group(1), match.group(2), tensor)
        if entries is None:
            raise KeyError(unknown.format(name))
        converted.update(entries)
    return converted


def rope_config(config: dict) -> tuple[dict, float, str]:
    """(the RoPE parameters, rope_theta, rope_type) of a config.json: transformers 5 writes
    {"rope_parameters": {"rope_type", "rope_theta", ...}}; older configs have a top-level
    rope_theta plus an optional rope_scaling dict."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    theta = float(config.get("rope_theta", rope.get("rope_theta", 10000.0)))
    return rope, theta, rope.get("rope_type", rope.get("type", "default"))


def check_representable(model: str, unsupported: dict[str, bool]) -> None:
    """ValueError naming the config entries (True in `unsupported`) the plait model cannot represent."""
    if any(unsupported.values()):
        raise ValueError(f"plait {model} cannot represent this config: {[k for k, v in unsupported.items() if v]}")


def gqa_config(args, architecture: str, model_type: str, intermediate_size: int, rope_scaling: dict | None,
               **flags: bool) -> dict:
    """config.json's entries for a grouped-query-attention decoder (Llama 3, Qwen3), in their
    released files' order; `flags`: the model's own switches, written after attention_dropout."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": intermediate_size,
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
        **flags,
        "initializer_range": 0.02,
        "use_cache": True,
    }


def gqa_args(config: dict, max_seq_len: int) -> dict:
    """The ModelArgs keywords a grouped-query-attention decoder's config.json gives alike (Llama 3,
    Qwen3); `max_seq_len` where it names no max_position_embeddings."""
    n_heads = config["num_attention_heads"]
    return dict(
        dim=config["hidden_size"],
        n_layers=config["num_hidden_layers"],
        n_heads=n_heads,
        n_kv_heads=config.get("num_key_value_heads") or n_heads,
        vocab_size=config["vocab_size"],
        norm_eps=config.get("rms_norm_eps", 1e-6),
        max_seq_len=config.get("max_position_embeddings", max_seq_len),
        tie_embeddings=config.get("tie_word_embeddings", False),
    )
