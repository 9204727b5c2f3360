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

import torch

from plait.models.hf import common, experts
from plait.models.hf.rotary import rotary_rows
from plait.models.qwen3.args import ModelArgs
from plait.models.qwen3.flavors import QWEN3_VOCAB_SIZE

HF_ARCHITECTURE = "Qwen3ForCausalLM"
HF_MOE_ARCHITECTURE = "Qwen3MoeForCausalLM"
# Every architecture this adapter reads (plait.checkpoint matches a folder's against them).
HF_ARCHITECTURES = (HF_ARCHITECTURE, HF_MOE_ARCHITECTURE)

_PER_LAYER = {
    **common.GQA_PROJECTIONS,
    "attention.q_norm.weight": "self_attn.q_norm.weight",
    "attention.k_norm.weight": "self_attn.k_norm.weight",
    **common.NORMS,
    **common.FEED_FORWARD,
    **common.ROUTER_GATE,
}
# Rows (or norm weights) laid out per head in RoPE's pair order.
_ROTARY = {"attention.wq.weight", "attention.wk.weight", "attention.q_norm.weight", "attention.k_norm.weight"}
_EXPERT_BIAS = "moe.router.expert_bias"


def to_hf(state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """plait -> HF names and layouts; works on any subset of the state dict (per-layer export)."""

    def layer(index: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = f"model.layers.{index}"
        if suffix == _EXPERT_BIAS:
            _check_no_bias(f"layers.{index}.{suffix}", tensor)
            return {}
        if suffix in _PER_LAYER:
            return {f"{prefix}.{_PER_LAYER[suffix]}": rotary_rows(tensor, args.head_dim, True) if suffix in _ROTARY else tensor}
        if suffix in experts.PROJECTIONS:  # [E, in, out] -> E x nn.Linear weight [out, in]
            return experts.to_hf(prefix, suffix, tensor)
        return None

    return common.to_hf(state_dict, layer, tied=args.tie_embeddings)


def _check_no_bias(name: str, bias_E: torch.Tensor) -> None:
    if not bias_E.is_meta and bool(bias_E.any()):
        raise ValueError(f"{name} is not zero (trained with model.load_balance_coeff > 0): Hugging Face's Qwen3-MoE "
                         "routes without a selection bias, so the export would pick other experts; balance with "
                         "model.aux_loss_coeff instead (load_balance_coeff = 0), or keep plait's own checkpoint")


def from_hf(hf_state_dict: dict[str, torch.Tensor], args: ModelArgs) -> dict[str, torch.Tensor]:
    """HF names/layouts -> plait; works on any subset holding whole layers (a layer-at-a-time import)."""
    per_layer = {hf: plait for plait, hf in _PER_LAYER.items()}
    routed = experts.ExpertCollector(args.n_routed_experts)

    def layer(index: str, suffix: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        prefix = f"layers.{index}"
        if suffix in per_layer:
            plait_suffix = per_layer[suffix]
            rotary = plait_suffix in _ROTARY
            converted = {f"{prefix}.{plait_suffix}": rotary_rows(tensor, args.head_dim, False) if rotary else tensor}
            if plait_suffix == "moe.router.gate.weight":  # [E, dim]: the bias HF has not
                converted[f"{prefix}.{_EXPERT_BIAS}"] = torch.zeros(tensor.shape[0], dtype=torch.float32)
            return converted
        if experts.is_hf_expert(suffix):  # per expert, or transformers 5's fused form
            routed.add(prefix, suffix, tensor)
            return {}
        return None

    return common.from_hf(hf_state_dict, layer, routed=routed, tied=args.tie_embeddings)


def hf_config(args: ModelArgs) -> dict:
    """`config.json` for Qwen3ForCausalLM, or Qwen3MoeForCausalLM when the model routes experts, in
    the released checkpoints' format (rope_theta at the top), which transformers 4.5x and 5.x read."""
    if args.is_moe and args.load_balance_coeff > 0:
        raise ValueError(f"Hugging Face's Qwen3-MoE routes without a selection bias and this model balances its experts "
                         f"with one (load_balance_coeff = {args.load_balance_coeff}), so an export would pick other experts: "
                         "train with --model.load_balance_coeff 0 (balance with model.aux_loss_coeff) to export to Hugging "
                         "Face, or keep plait's own checkpoint")  # fmt: skip
    config = common.gqa_config(args, HF_MOE_ARCHITECTURE if args.is_moe else HF_ARCHITECTURE,
                               "qwen3_moe" if args.is_moe else "qwen3", args.inter_dim, None, use_sliding_window=False)
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
    _, rope_theta, rope_type = common.rope_config(config)
    common.check_representable("qwen3", {
        "hidden_act": config.get("hidden_act", "silu") != "silu",
        "attention_bias": config.get("attention_bias", False),
        "use_sliding_window": config.get("use_sliding_window", False),
        "rope_scaling": rope_type != "default",
        # plait's MoE blocks are all MoE: no dense block among them.
        "mlp_only_layers": moe and bool(config.get("mlp_only_layers")),
        "decoder_sparse_step": moe and config.get("decoder_sparse_step", 1) != 1,
    })  # fmt: skip
    moe_args = dict(
        # "num_local_experts" is the name transformers 5's to_dict writes.
        n_routed_experts=config.get("num_experts") or config["num_local_experts"],
        n_activated_experts=config["num_experts_per_tok"],
        moe_inter_dim=config["moe_intermediate_size"],
        route_norm=bool(config.get("norm_topk_prob", False)),
        aux_loss_coeff=float(config.get("router_aux_loss_coef", 0.001)),
    ) if moe else {}  # fmt: skip
    return ModelArgs(
        **common.gqa_args(config, max_seq_len=40960),
        head_dim=config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"],
        inter_dim=config["intermediate_size"],
        rope_theta=rope_theta,
        **moe_args,
    )
