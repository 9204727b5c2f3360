"""Named Qwen3 sizes: the released Qwen3 dense and MoE models (their config.json) plus two debug models.

Every release has head_dim 128, vocab 151936, RoPE theta 1e6, RMSNorm eps 1e-6 and 40960 positions
(`max_seq_len` only sizes the RoPE tables, so a trainer may lower it to its sequence length).
"""

from plait.models.qwen3.args import ModelArgs

QWEN3_VOCAB_SIZE = 151936


def _dense(dim: int, n_layers: int, n_heads: int, inter_dim: int, tie: bool = False) -> ModelArgs:
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=8, inter_dim=inter_dim, tie_embeddings=tie)


def _moe(dim: int, n_layers: int, n_heads: int, inter_dim: int, moe_inter_dim: int) -> ModelArgs:
    # 128 experts, top-8, renormalised top-k weights, no shared expert, 4 kv heads.
    return ModelArgs(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=4, inter_dim=inter_dim,
                     n_routed_experts=128, n_activated_experts=8, moe_inter_dim=moe_inter_dim)


# The debug models: Llama 3 debug's width, depth and vocab (its small test tokenizer), GQA with head
# dim 32 (at head dim <= 16 a bf16 CPU run would attend in fp32: plait.models.cpu_bf16).
_DEBUG = dict(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, head_dim=32, vocab_size=2048, inter_dim=768,
              max_seq_len=2048)

FLAVORS: dict[str, ModelArgs] = {
    "debugmodel": ModelArgs(**_DEBUG),
    # 8 routed experts, top-2, every block MoE (as in the releases).
    "debugmodel_moe": ModelArgs(**_DEBUG, n_routed_experts=8, n_activated_experts=2, moe_inter_dim=256),
    "0.6B": _dense(1024, 28, 16, 3072, tie=True),
    "1.7B": _dense(2048, 28, 16, 6144, tie=True),
    "4B": _dense(2560, 36, 32, 9728, tie=True),
    "8B": _dense(4096, 36, 32, 12288),
    "14B": _dense(5120, 40, 40, 17408),
    "32B": _dense(5120, 64, 64, 25600),
    # Qwen3-30B-A3B and Qwen3-235B-A22B (inter_dim: their config's dense size, used by no block).
    "30B-A3B": _moe(2048, 48, 32, 6144, 768),
    "235B-A22B": _moe(4096, 94, 64, 12288, 1536),
}
