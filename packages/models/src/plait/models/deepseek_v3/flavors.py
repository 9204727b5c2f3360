"""Named DeepSeek configurations: a tiny debug model, the published V2-Lite, V2 and V3 sizes, and
Kimi K2 (Moonshot AI, 2025: DeepSeek-V3's architecture at 1T parameters, released under its weight names).

RoPE tables are built for 16K positions (torchtitan's choice; YaRN is on because that exceeds the
original 4K). Override `max_seq_len` for longer context, e.g. 163840 as in the released configs.
"""

import dataclasses

from plait.models.deepseek_v3.args import ModelArgs

FLAVORS: dict[str, ModelArgs] = {
    # torchtitan's debug dimensions: 6 layers, 8 routed + 2 shared experts, top-3.
    "debugmodel": ModelArgs(
        vocab_size=2048,
        dim=256,
        inter_dim=1024,
        moe_inter_dim=256,
        n_layers=6,
        n_dense_layers=1,
        n_heads=16,
        n_routed_experts=8,
        n_shared_experts=2,
        n_activated_experts=3,
        score_func="softmax",
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.70,
    ),
    # DeepSeek-V2-Lite (15.7B total, 2.4B active).
    "16B": ModelArgs(
        vocab_size=102400,
        dim=2048,
        inter_dim=10944,
        moe_inter_dim=1408,
        n_layers=27,
        n_dense_layers=1,
        n_heads=16,
        norm_eps=1e-6,
        n_routed_experts=64,
        n_shared_experts=2,
        n_activated_experts=6,
        score_func="softmax",
        q_lora_rank=0,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.707,
    ),
    # DeepSeek-V2 (236B total, 21B active).
    "236B": ModelArgs(
        vocab_size=102400,
        dim=5120,
        inter_dim=12288,
        moe_inter_dim=1536,
        n_layers=60,
        n_dense_layers=1,
        n_heads=128,
        norm_eps=1e-6,
        n_routed_experts=160,
        n_shared_experts=2,
        n_activated_experts=6,
        score_func="softmax",
        route_scale=16.0,
        n_expert_groups=8,
        n_limited_groups=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=0.707,
    ),
    # DeepSeek-V3 (671B total, 37B active; without the multi-token-prediction module).
    "671B": ModelArgs(
        vocab_size=129280,
        dim=7168,
        inter_dim=18432,
        moe_inter_dim=2048,
        n_layers=61,
        n_dense_layers=3,
        n_heads=128,
        norm_eps=1e-6,
        n_routed_experts=256,
        n_shared_experts=1,
        n_activated_experts=8,
        score_func="sigmoid",
        route_norm=True,
        route_scale=2.5,
        n_expert_groups=8,
        n_limited_groups=4,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        mscale=1.0,
    ),
}

# Kimi K2 (1.04T total, 32B active): DeepSeek-V3 with 384 routed experts (top-8, no expert groups),
# one dense block, 64 heads and a 163840-token vocabulary; RoPE theta 50000 with YaRN x32 over 4096
# positions (beta_fast = beta_slow = 1).
FLAVORS["kimi_k2"] = dataclasses.replace(
    FLAVORS["671B"],
    vocab_size=163840,
    n_dense_layers=1,
    n_heads=64,
    n_routed_experts=384,
    route_scale=2.827,
    n_expert_groups=1,
    n_limited_groups=1,
    rope_theta=50000.0,
    rope_factor=32.0,
    beta_fast=1.0,
)
