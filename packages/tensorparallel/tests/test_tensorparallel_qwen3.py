"""Per-head norms under tensor parallel: transformers' Qwen3ForCausalLM (q_norm / k_norm, RMSNorm over
head_dim applied to each head of the colwise q_proj / k_proj output) trains like one process.

The model is transformers' own (tiny config built here, fp32, SDPA, no hub download), parallelised
by the README's QWEN3_TP_PLAN only. One 4-rank spawn runs, on fresh meshes:
- fsdp2_tp2_sp_lp: FSDP 2 (torch's fully_shard over the dp mesh; this package's tests may not use
  plait-dataparallel) x TP 2 with sequence and loss parallel; FSDP reduces the head norms' gradients;
- fsdp2_tp2: the same without sequence / loss parallel;
- tp2: TP 2 alone (both dp groups run the same batch), where head_norm reduces its own gradients.
AdamW, losses at every step and every parameter after within 1e-5 of one process.

The misuses are refused in this process on a fake 2-rank group (nothing communicates): `replicate`
on q_norm at the first forward, `sequence_parallel` on it when the plan is applied, and under SP a
forward without full-sequence position_ids (or, with eager attention, a full-sequence 4D mask) at the
attention's entry.
"""

import ast
import math
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.mesh import ParallelDims, build_meshes
from plait.tensorparallel import (
    TensorParallelConfig,
    TensorParallelConfigError,
    apply_tensor_parallel,
    loss_parallel_context,
    uses_loss_parallel,
)
from plait.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 2, 4, 2, 16, 256
BATCH, SEQ, STEPS = 4, 32, 3

# The plan from packages/tensorparallel/README.md ("Your own model"), as a user copies it.
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


def make_model(attn: str = "sdpa"):
    config = transformers.Qwen3Config(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation=attn,
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


# name -> (sequence_parallel and loss_parallel, FSDP over the dp mesh)
LAYOUTS = {"fsdp2_tp2_sp_lp": (True, True), "fsdp2_tp2": (False, True), "tp2": (False, False)}


def _run_layouts(rank, world_size):
    from torch.distributed.fsdp import fully_shard

    torch.use_deterministic_algorithms(True)
    out = {}
    for name, (sp, fsdp) in LAYOUTS.items():
        meshes = build_meshes(ParallelDims(world_size=world_size, dp_shard=2, tp=2))
        config = TensorParallelConfig(sequence_parallel=sp, loss_parallel=sp)
        model = apply_tensor_parallel(make_model(), meshes.tp, QWEN3_TP_PLAN, config)
        lp = uses_loss_parallel(QWEN3_TP_PLAN, config, meshes.tp.size())
        if fsdp:
            for layer in model.model.layers:
                fully_shard(layer, mesh=meshes.fsdp)
            fully_shard(model, mesh=meshes.fsdp)
            losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), loss_parallel=lp)
        else:
            losses = train(model, loss_parallel=lp)
        out[name] = (losses, full_params(model))
    return out


def test_qwen3_head_norms_train_like_one_process():
    reference = make_model()
    ref_losses = train(reference)
    ref_params = full_params(reference)
    assert all(math.isfinite(x) for x in ref_losses) and ref_losses[-1] < ref_losses[0], ref_losses
    results = run_on_ranks(_run_layouts, 4, timeout=240)
    for name in LAYOUTS:
        for rank, result in enumerate(results):
            losses, params = result[name]
            assert losses == pytest.approx(ref_losses, abs=1e-5), (name, rank, losses, ref_losses)
            assert params.keys() == ref_params.keys()
            for pname, ref in ref_params.items():
                torch.testing.assert_close(params[pname], ref, atol=1e-5, rtol=1e-4, msg=f"{name} rank {rank} {pname}")


@pytest.fixture
def tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    finally:
        dist.destroy_process_group()


def test_misused_head_norm_styles_and_shard_positions_are_refused(tp_mesh):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ)[None]
    no_sp = TensorParallelConfig(sequence_parallel=False, loss_parallel=False)
    plan = {**QWEN3_TP_PLAN, "model.layers.*.self_attn.q_norm": "replicate"}
    model = apply_tensor_parallel(make_model(), tp_mesh, plan, no_sp)
    with pytest.raises(
        ValueError,
        match=r"^plan entry 'model.layers.0.self_attn.q_norm': 'replicate' got the output of a 'colwise' projection "
        r"\(this rank's heads\).* mark 'model.layers.0.self_attn.q_norm' 'head_norm'",
    ):
        model(input_ids=tokens, position_ids=positions)
    plan = {**QWEN3_TP_PLAN, "model.layers.*.self_attn.k_norm": "sequence_parallel"}
    with pytest.raises(
        TensorParallelConfigError,
        match=r"^plan entry 'model.layers.0.self_attn.k_norm': 'sequence_parallel' is for norms on the residual "
        r"stream .* inside the region 'model.layers.0.self_attn'; mark it 'head_norm'",
    ):
        apply_tensor_parallel(make_model(), tp_mesh, plan, no_sp)
    model = apply_tensor_parallel(make_model(), tp_mesh, QWEN3_TP_PLAN, TensorParallelConfig(loss_parallel=False))
    with pytest.raises(
        ValueError,
        match=r"^plan entry 'model.layers.0.self_attn': under sequence parallel the region gathers the sequence to "
        rf"{SEQ} tokens, but 'position_ids' has shape \(1, {SEQ // 2}\), of the local shard's .* Pass full-sequence "
        "position_ids",
    ):
        model(input_ids=tokens)
    # Eager attention: transformers builds the causal mask from the shard too.
    model = apply_tensor_parallel(
        make_model("eager"), tp_mesh, QWEN3_TP_PLAN, TensorParallelConfig(loss_parallel=False)
    )
    with pytest.raises(ValueError, match=rf"'attention_mask' has shape \({BATCH}, 1, {SEQ // 2}, {SEQ // 2}\)"):
        model(input_ids=tokens, position_ids=positions)


def test_the_readme_plan_is_the_tested_plan():
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    plan = re.search(r"^QWEN3_TP_PLAN = (\{.*?^\})", readme, re.S | re.M)
    assert plan is not None, "packages/tensorparallel/README.md lost its QWEN3_TP_PLAN"
    assert ast.literal_eval(plan.group(1)) == QWEN3_TP_PLAN
