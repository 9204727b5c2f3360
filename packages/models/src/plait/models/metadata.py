"""What every plait model declares as data in `parallel_info()` (docs/contracts.md): the pieces of
its tensor-parallel plan that the models share, and the dict itself. The parallel packages read
it; they do not know the model classes."""

# The ends of the model, outside the blocks.
EDGE_PLAN = {
    "tok_embeddings": "embedding_rowwise",
    "norm": "sequence_parallel",
    "output": "output_colwise",
}
# Grouped-query attention's projections (Llama 3, Qwen3): whole heads per tp rank.
GQA_PROJECTIONS = {
    "layers.*.attention.wq": "colwise",
    "layers.*.attention.wk": "colwise",
    "layers.*.attention.wv": "colwise",
}
DENSE_FFN_PLAN = {
    "layers.*.feed_forward": "prepare_input",
    "layers.*.feed_forward.w1": "colwise",
    "layers.*.feed_forward.w2": "rowwise",
    "layers.*.feed_forward.w3": "colwise",
}


def attention_plan(projections: dict[str, str]) -> dict[str, str]:
    """A pre-norm block's attention half: its norm, the attention's inputs, `projections` (the
    model's q / k / v), the output projection summing heads back (rowwise), then the FFN's norm."""
    return {
        "layers.*.attention_norm": "sequence_parallel",
        "layers.*.attention": "prepare_input",
        **projections,
        "layers.*.attention.wo": "rowwise",
        "layers.*.ffn_norm": "sequence_parallel",
    }


def moe_plan(shared_experts: bool) -> dict[str, str]:
    return {
        "layers.*.moe": "moe_input_output",
        "layers.*.moe.router.gate": "replicate",
        **({
            "layers.*.moe.shared_experts.w1": "colwise",
            "layers.*.moe.shared_experts.w2": "rowwise_partial",
            "layers.*.moe.shared_experts.w3": "colwise",
        } if shared_experts else {}),
        # Routed experts: hidden dim split over tp when there is no expert parallel; with
        # ep > 1 the expert-parallel package owns them and this entry is skipped.
        "layers.*.moe.experts": "experts_tp",
    }  # fmt: skip


def parallel_info(
    blocks: list[str],
    tp_plan: dict[str, str],
    experts: list[str],
    heads: tuple[int, int, int],
    tp_divisible: dict[str, int],
    *,
    tied: bool = False,
    expert_overlap: dict[str, str] | None = None,
    attention_blocks: list[str] | None = None,
) -> dict:
    """`blocks`: the repeated units (FSDP, activation checkpointing, compile); `attention_blocks`
    (default: `blocks`) the ones holding `attention.sdpa`; `heads`: (n_heads, n_kv_heads,
    head_dim) before tensor parallel; `expert_overlap`: an MoE model's (None: the key is left out)."""
    info = {"blocks": blocks, "tp_plan": tp_plan, "experts": experts}
    if expert_overlap is not None:
        # The module each MoE runs after its experts and before it first uses their output: expert
        # parallel overlaps the combine all-to-all with it, forward and backward.
        info["expert_overlap"] = expert_overlap
    n_heads, n_kv_heads, head_dim = heads
    info.update({
        "attention_modules": [f"{block}.attention.sdpa" for block in (blocks if attention_blocks is None else attention_blocks)],
        # FSDP units outside the blocks, in forward order: the embedding (resharded once used) and
        # the output head. A tied embedding is one weight in both: it stays with the root.
        "edge_units": [] if tied else [["tok_embeddings"], ["norm", "output"]],
        # Head counts the attention modules see before tensor parallel (context parallel's
        # all-to-all splits heads over cp ranks).
        "attention_heads": {"n_heads": n_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim},
        # Sizes tensor parallel splits: whole heads per rank, FFN hidden sizes, vocab.
        "tp_divisible": tp_divisible,
    })  # fmt: skip
    return info
