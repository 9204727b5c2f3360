"""What Qwen3 declares as data: its parallel_info() (blocks, TP plan, experts, CP heads) and its
parameter counts. The parallel packages read this; they do not know the model class."""

from plait.models import metadata
from plait.models.qwen3.args import ModelArgs

# RMSNorm over head_dim on each of this rank's heads (the colwise outputs of wq and wk): the
# weight is replicated and its gradient summed over the tp ranks.
_HEAD_NORMS = {"layers.*.attention.q_norm": "head_norm", "layers.*.attention.k_norm": "head_norm"}


def parallel_info(args: ModelArgs, layer_names: list[str]) -> dict:
    """`layer_names`: the model's `layers` keys (a pipeline stage holds some of them)."""
    blocks = [f"layers.{name}" for name in layer_names]
    ffn_plan = metadata.moe_plan(shared_experts=False) if args.is_moe else metadata.DENSE_FFN_PLAN
    return metadata.parallel_info(
        blocks,
        {**metadata.EDGE_PLAN, **metadata.attention_plan({**metadata.GQA_PROJECTIONS, **_HEAD_NORMS}), **ffn_plan},
        experts=[f"{block}.moe.experts" for block in blocks] if args.is_moe else [],
        heads=(args.n_heads, args.n_kv_heads, args.head_dim),
        tp_divisible={"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads,
                      **({} if args.is_moe else {"ffn_hidden": args.inter_dim}), "vocab_size": args.vocab_size},
        tied=args.tie_embeddings,
        # No shared expert: nothing runs between the experts and the first use of their output.
        expert_overlap={},
    )


def param_counts(args: ModelArgs) -> tuple[int, int]:
    """(total, active per token) parameters. Active keeps only the top-k routed experts of each MoE
    block (plus attention, the router, norms, embedding and head). A tied head counts once."""
    a = args
    q_o = 2 * a.dim * a.n_heads * a.head_dim
    k_v = 2 * a.dim * a.n_kv_heads * a.head_dim
    attention = q_o + k_v + 2 * a.head_dim + 2 * a.dim  # + q_norm, k_norm and the two block norms
    expert = 3 * a.dim * a.moe_inter_dim
    if a.is_moe:
        fixed_ffn, total_ffn, active_ffn = a.dim * a.n_routed_experts, a.n_routed_experts * expert, a.n_activated_experts * expert
    else:
        fixed_ffn, total_ffn, active_ffn = 0, 3 * a.dim * a.inter_dim, 3 * a.dim * a.inter_dim
    outside = (1 if a.tie_embeddings else 2) * a.vocab_size * a.dim + a.dim  # embedding, head, final norm
    fixed = a.n_layers * (attention + fixed_ffn) + outside
    return fixed + a.n_layers * total_ffn, fixed + a.n_layers * active_ffn
