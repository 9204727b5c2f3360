"""What Qwen3 declares as data: its parallel_info() (blocks, TP plan, experts, CP heads) and its
parameter counts. The parallel packages read this; they do not know the model class."""

from plait.models.qwen3.args import ModelArgs

_ATTENTION_PLAN = {
    "layers.*.attention_norm": "sequence_parallel",
    "layers.*.attention": "prepare_input",
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
    # RMSNorm over head_dim on each of this rank's heads (the colwise outputs above): the weight is
    # replicated and its gradient summed over the tp ranks.
    "layers.*.attention.q_norm": "head_norm",
    "layers.*.attention.k_norm": "head_norm",
    "layers.*.attention.wo": "rowwise",
    "layers.*.ffn_norm": "sequence_parallel",
}
_DENSE_PLAN = {
    "layers.*.feed_forward": "prepare_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
}
_MOE_PLAN = {
    "layers.*.moe": "moe_input_output",
    "layers.*.moe.router.gate": "replicate",
    # Routed experts: hidden dim split over tp without expert parallel; with ep > 1 the
    # expert-parallel package owns them and this entry is skipped.
    "layers.*.moe.experts": "experts_tp",
}


def parallel_info(args: ModelArgs, layer_names: list[str]) -> dict:
    """`layer_names`: the model's `layers` keys (a pipeline stage holds some of them)."""
    blocks = [f"layers.{name}" for name in layer_names]
    return {
        "blocks": blocks,
        "tp_plan": {
            "tok_embeddings": "embedding_rowwise",
            "norm": "sequence_parallel",
            "output": "output_colwise",
            **_ATTENTION_PLAN,
            **(_MOE_PLAN if args.is_moe else _DENSE_PLAN),
        },
        "experts": [f"{block}.moe.experts" for block in blocks] if args.is_moe else [],
        # No shared expert: nothing runs between the experts and the first use of their output.
        "expert_overlap": {},
        "attention_modules": [f"{block}.attention.sdpa" for block in blocks],
        # FSDP units outside the blocks, in forward order: the embedding (resharded once used) and
        # the output head. A tied embedding is one weight in both: it stays with the root.
        "edge_units": [] if args.tie_embeddings else [["tok_embeddings"], ["norm", "output"]],
        # Head counts the attention modules see before tensor parallel (Ulysses splits heads over cp).
        "attention_heads": {"n_heads": args.n_heads, "n_kv_heads": args.n_kv_heads, "head_dim": args.head_dim},
        # Sizes tensor parallel splits: heads and kv heads (whole heads per rank), FFN hidden, vocab.
        "tp_divisible": {
            "n_heads": args.n_heads,
            "n_kv_heads": args.n_kv_heads,
            **({} if args.is_moe else {"ffn_hidden": args.inter_dim}),
            "vocab_size": args.vocab_size,
        },
    }


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
