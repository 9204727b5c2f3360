"""Bring your own model with per-head norms: transformers' Qwen3ForCausalLM (q_norm / k_norm, RMSNorm over
head_dim on each head of the colwise q_proj / k_proj output) under FSDP 2 (plait.dataparallel) x TP 2,
trained like one process (issue 44).

The plan is packages/tensorparallel/README.md's QWEN3_TP_PLAN: the norms are `head_norm`, whose weight
gradients are summed over the tp ranks (FSDP reduces them on its 2-D mesh). One 4-rank spawn runs both
cases, with and without sequence / loss parallel; AdamW, losses at every step and every parameter after
within 1e-5 of one process.
"""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.tensorparallel import TensorParallelConfig, apply_tensor_parallel, loss_parallel_context, uses_loss_parallel
from plait.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 256
BATCH, SEQ, STEPS = 4, 32, 3
TIMEOUT = 240

QWEN3_TP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "prepare_input(hidden_states)",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.q_norm": "head_norm",  # RMSNorm over head_dim of each local head
    "model.layers.*.self_attn.k_norm": "head_norm",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp": "prepare_input(x)",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence_parallel",
    "lm_head": "output_colwise",
}
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]
EDGE_UNITS = [["model.embed_tokens"], ["model.norm", "lm_head"]]


def make_model():
    config = transformers.Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # norms away from ones, so that their weights matter per head
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model


def train(model, dp_rank=0, dp_degree=1, dp_group=None, loss_parallel=False):
    """STEPS of AdamW on this rank's rows of each batch; the global mean losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    per = BATCH // dp_degree
    positions = torch.arange(SEQ)[None]  # the full sequence (under SP the layers get a shard)
    losses = []
    for _ in range(STEPS):
        rows = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)[dp_rank * per : (dp_rank + 1) * per]
        with loss_parallel_context(loss_parallel):
            logits = model(input_ids=rows[:, :-1], position_ids=positions).logits
            loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        loss = (loss.full_tensor() if isinstance(loss, DTensor) else loss).detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / dist.get_world_size(dp_group)
        losses.append(loss.item())
    return losses


def full_params(model) -> dict[str, torch.Tensor]:
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


# name -> sequence parallel and loss parallel
CASES = {"fsdp2_tp2_sp_lp": True, "fsdp2_tp2": False}


def _run_cases(rank, world_size):
    torch.use_deterministic_algorithms(True)
    out = {}
    for name, sp in CASES.items():
        meshes = build_meshes(ParallelDims(world_size=world_size, dp_shard=2, tp=2))
        config = TensorParallelConfig(sequence_parallel=sp, loss_parallel=sp)
        model = apply_tensor_parallel(make_model(), meshes.tp, QWEN3_TP_PLAN, config)
        model = apply_data_parallel(model, meshes, BLOCKS, DataParallelConfig(), edge_units=EDGE_UNITS)
        lp = uses_loss_parallel(QWEN3_TP_PLAN, config, meshes.tp.size())
        losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), loss_parallel=lp)
        out[name] = (losses, full_params(model))
    return out


def test_transformers_qwen3_fsdp_tp_matches_single_process():
    reference = make_model()
    ref_losses = train(reference)
    ref_params = full_params(reference)
    assert all(math.isfinite(x) for x in ref_losses) and ref_losses[-1] < ref_losses[0], ref_losses
    results = run_on_ranks(_run_cases, 4, timeout=TIMEOUT)
    for name in CASES:
        for rank, result in enumerate(results):
            losses, params = result[name]
            assert losses == pytest.approx(ref_losses, abs=1e-5), (name, rank, losses, ref_losses)
            assert params.keys() == ref_params.keys()
            for pname, ref in ref_params.items():
                torch.testing.assert_close(params[pname], ref, atol=1e-5, rtol=1e-4, msg=f"{name} rank {rank} {pname}")
