"""Bring your own model: transformers' LlamaForCausalLM, which plait did not write, under plait's
parallel packages, trained like one process (issue 26).

The model is transformers' own (a tiny LlamaConfig, no hub download, fp32), built from one seed on
every rank; it is parallelised only by plan data and package calls, never edited:
- fsdp2_tp2_sp_lp: FSDP 2 (plait.dataparallel) x TP 2 with sequence and loss parallel, SDPA;
- fsdp2_tp2_sp_eager: FSDP 2 x TP 2 with SP, transformers' eager attention, given the full-sequence
  causal mask as a 4D tensor (under SP transformers would build it for the local sequence shard).
- cp2_allgather / cp2_ring / cp2_ulysses: CP 2 (FSDP over the cp ranks) through transformers'
  attention interface: plait.contextparallel.ContextParallelSDPA registered as "plait_cp", each rank
  feeding its load-balanced (head-tail) tokens with their positions as position_ids (RoPE);
- fsdp2_cp2_tp2_ring: FSDP 2 x CP 2 (ring) x TP 2 with SP and loss parallel, 8 ranks;
- qwen3_fsdp2_tp2_sp_lp / qwen3_fsdp2_tp2: transformers' Qwen3ForCausalLM (per-head q_norm / k_norm,
  `head_norm` in the tensorparallel README's QWEN3_TP_PLAN) under FSDP 2 x TP 2, with and without SP.
Each must match the single-process run: losses at every step within the parity matrix's fp32
tolerance (1e-5), parameters after the last step within 1e-5 (SGD with momentum).

PLAIT_PARITY_DEVICE=cuda (the GPU lease's parity stage, gpu/parity.py): the same cases on CUDA, the
ranks sharing the GPU over gloo (comm.backend gloo's path), each against one process on that GPU.

Layout: one function per case (`rank, world_size -> (losses, full parameters)`), listed in CASES
with its world size and its single-process reference; one spawn per world size runs all of that size's
cases in turn, on fresh meshes. To add a case (e.g. context parallel, CP 2 per method, FSDP 2 x
CP 2 x TP 2), write its function and add it to CASES: a new world size gets its own spawn.
"""

import ast
import math
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from plait.contextparallel import ContextParallelConfig, ContextParallelSDPA, shard_batch
from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.tensorparallel import TensorParallelConfig, apply_tensor_parallel, loss_parallel_context, uses_loss_parallel
from plait.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 256
BATCH, SEQ, STEPS, LR = 4, 64, 4, 0.5
TIMEOUT = 240
DEVICE = os.environ.get("PLAIT_PARITY_DEVICE", "cpu")

# The plan from packages/tensorparallel/README.md ("Your own model"), as a user copies it.
LLAMA_TP_PLAN = {
    "model.embed_tokens": "embedding_rowwise",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.self_attn": "prepare_input(hidden_states)",  # called as self_attn(hidden_states=...)
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.layers.*.mlp": "prepare_input(x)",  # LlamaMLP.forward(self, x)
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "model.norm": "sequence_parallel",
    "lm_head": "output_colwise",
}
BLOCKS = [f"model.layers.{i}" for i in range(LAYERS)]
EDGE_UNITS = [["model.embed_tokens"], ["model.norm", "lm_head"]]


def _readme_plan(name: str) -> dict:
    readme = (Path(__file__).parents[1] / "packages/tensorparallel/README.md").read_text()
    plan = re.search(rf"^{name} = (\{{.*?^\}})", readme, re.S | re.M)
    assert plan is not None, f"packages/tensorparallel/README.md lost its {name}"
    return ast.literal_eval(plan.group(1))


# Qwen3's per-head q_norm / k_norm are `head_norm` (their weight gradients summed over tp), as the
# README's plan has them.
QWEN3_TP_PLAN = _readme_plan("QWEN3_TP_PLAN")


def make_model(attn: str = "sdpa", model: str = "llama"):
    if model == "qwen3":
        return make_qwen3()
    config = transformers.LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float().to(DEVICE)


def make_qwen3():
    config = transformers.Qwen3Config(hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HIDDEN // HEADS,
                                      vocab_size=VOCAB, max_position_embeddings=SEQ, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).float()
    with torch.no_grad():  # norms away from ones, so that each head's norm weight matters
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.2)
    return model.to(DEVICE)


def batches():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g).to(DEVICE)


def causal_mask_4d() -> torch.Tensor:
    """[1, 1, S, S] additive causal mask of the full sequence (transformers passes a 4D mask on as is)."""
    allowed = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return torch.zeros(SEQ, SEQ).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None].to(DEVICE)


def train(model, dp_rank=0, dp_degree=1, dp_group=None, loss_parallel=False, mask=False, cp_sdpa=None, cp_rank=0):
    """STEPS of SGD with momentum on this rank's rows of the global batch; the global mean losses.

    Under context parallel (`cp_sdpa`), each rank takes its tokens of the rows (`shard_batch`) and
    passes their positions as position_ids (RoPE); every rank holds as many tokens, so the mean of
    the ranks' means over `dp_group` (dp x cp) is the global mean, and FSDP averages gradients alike."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per = BATCH // dp_degree
    # Positions of the full sequence: under SP, LlamaModel would derive them from the embedding's
    # output, which is a sequence shard (see the README).
    positions = torch.arange(SEQ, device=DEVICE)[None]
    extra = {"attention_mask": causal_mask_4d()} if mask else {}
    losses = []
    for batch in batches():
        rows = batch[dp_rank * per : (dp_rank + 1) * per]
        tokens, labels = rows[:, :-1], rows[:, 1:]
        position_ids = positions
        if cp_sdpa is not None:  # this cp rank's tokens, labels and where they sit in the sequence
            tokens, labels, position_ids = shard_batch(tokens, labels, cp_rank, cp_sdpa.layout)
            position_ids = position_ids[None]
        with loss_parallel_context(loss_parallel):
            logits = model(input_ids=tokens, position_ids=position_ids, **extra).logits
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
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
    return {
        n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone() for n, p in model.named_parameters()
    }


def _fsdp_tp(world_size: int, sp: bool, lp: bool, attn: str, mask: bool = False, model_name: str = "llama"):
    meshes = build_meshes(ParallelDims(world_size=world_size, dp_shard=2, tp=2), DEVICE)
    config = TensorParallelConfig(sequence_parallel=sp, loss_parallel=lp)
    plan = QWEN3_TP_PLAN if model_name == "qwen3" else LLAMA_TP_PLAN
    model = apply_tensor_parallel(make_model(attn, model_name), meshes.tp, plan, config)
    model = apply_data_parallel(model, meshes, BLOCKS, DataParallelConfig(), edge_units=EDGE_UNITS)
    lp_on = uses_loss_parallel(plan, config, meshes.tp.size())
    losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), loss_parallel=lp_on, mask=mask)
    return losses, full_params(model)


def case_fsdp2_tp2_sp_lp(rank, world_size):
    return _fsdp_tp(world_size, sp=True, lp=True, attn="sdpa")


def case_fsdp2_tp2_sp_eager(rank, world_size):
    return _fsdp_tp(world_size, sp=True, lp=False, attn="eager", mask=True)


def case_qwen3_fsdp2_tp2_sp_lp(rank, world_size):
    return _fsdp_tp(world_size, sp=True, lp=True, attn="sdpa", model_name="qwen3")


def case_qwen3_fsdp2_tp2(rank, world_size):
    return _fsdp_tp(world_size, sp=False, lp=False, attn="sdpa", model_name="qwen3")


def _cp(world_size: int, method: str, dp_shard: int = 1, tp: int = 1):
    """Context parallel through transformers' attention interface: ContextParallelSDPA registered as
    an attention implementation (the README's "Your own model"), TP (with SP and loss parallel) by
    plan first, then FSDP over dp_shard x cp."""
    meshes = build_meshes(ParallelDims(world_size=world_size, dp_shard=dp_shard, cp=2, tp=tp), DEVICE)
    model = make_model("sdpa")
    cp_sdpa = ContextParallelSDPA(meshes.cp, ContextParallelConfig(method))
    transformers.AttentionInterface.register("plait_cp", cp_sdpa.transformers_attention)
    model.set_attn_implementation("plait_cp")
    lp_on = False
    if tp > 1:
        config = TensorParallelConfig(sequence_parallel=True, loss_parallel=True)
        model = apply_tensor_parallel(model, meshes.tp, LLAMA_TP_PLAN, config)
        lp_on = uses_loss_parallel(LLAMA_TP_PLAN, config, meshes.tp.size())
    model = apply_data_parallel(model, meshes, BLOCKS, DataParallelConfig(), edge_units=EDGE_UNITS)
    cp_rank = meshes.cp.get_local_rank()
    dp_cp = meshes.dp_cp.get_group()
    losses = train(model, meshes.dp_rank, meshes.dp_degree, dp_cp, lp_on, cp_sdpa=cp_sdpa, cp_rank=cp_rank)
    return losses, full_params(model)


def case_cp2_allgather(rank, world_size):
    return _cp(world_size, "allgather")


def case_cp2_ring(rank, world_size):
    return _cp(world_size, "ring")


def case_cp2_ulysses(rank, world_size):
    return _cp(world_size, "ulysses")


def case_fsdp2_cp2_tp2_ring(rank, world_size):
    return _cp(world_size, "ring", dp_shard=2, tp=2)


# name -> (world size, case function, its single-process reference: (attn_implementation, 4D mask, model))
CASES = {
    "fsdp2_tp2_sp_lp": (4, case_fsdp2_tp2_sp_lp, ("sdpa", False)),
    "fsdp2_tp2_sp_eager": (4, case_fsdp2_tp2_sp_eager, ("eager", True)),
    # transformers' Qwen3 (per-head norms, issue 44) by the README's plan, with and without SP.
    "qwen3_fsdp2_tp2_sp_lp": (4, case_qwen3_fsdp2_tp2_sp_lp, ("sdpa", False, "qwen3")),
    "qwen3_fsdp2_tp2": (4, case_qwen3_fsdp2_tp2, ("sdpa", False, "qwen3")),
    "cp2_allgather": (2, case_cp2_allgather, ("sdpa", False)),
    "cp2_ring": (2, case_cp2_ring, ("sdpa", False)),
    "cp2_ulysses": (2, case_cp2_ulysses, ("sdpa", False)),
    "fsdp2_cp2_tp2_ring": (8, case_fsdp2_cp2_tp2_ring, ("sdpa", False)),
}


def _run_cases(rank, world_size, names):
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS on CUDA
    torch.use_deterministic_algorithms(True)
    return {name: CASES[name][1](rank, world_size) for name in names}


@pytest.mark.parametrize("world_size", sorted({ws for ws, *_ in CASES.values()}))
def test_transformers_llama_matches_single_process(world_size):
    names = [name for name, (ws, *_) in CASES.items() if ws == world_size]
    references = {}
    for reference in sorted({CASES[name][2] for name in names}):
        attn, mask, *model_name = reference
        model = make_model(attn, *model_name)
        references[reference] = (train(model, mask=mask), full_params(model))
    results = run_on_ranks(_run_cases, world_size, names, timeout=TIMEOUT, device=DEVICE)
    for name in names:
        ref_losses, ref_params = references[CASES[name][2]]
        assert all(math.isfinite(x) for x in ref_losses) and ref_losses[-1] < ref_losses[0], ref_losses
        for rank, result in enumerate(results):
            losses, params = result[name]
            assert losses == pytest.approx(ref_losses, abs=1e-5), (name, rank, losses, ref_losses)
            assert params.keys() == ref_params.keys()
            for pname, ref in ref_params.items():
                torch.testing.assert_close(params[pname], ref, atol=1e-5, rtol=1e-4, msg=f"{name} rank {rank} {pname}")


def test_a_plan_that_misses_transformers_keyword_call_says_so():
    """transformers calls self_attn by keyword: a plan that converts the first positional argument,
    or names another argument, fails at the first forward with one line naming the entry and what
    the module was called with (a fake 2-rank group in one process: nothing communicates)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        tp_mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        tokens = batches()[0][:, :-1]
        config = TensorParallelConfig(sequence_parallel=False, loss_parallel=False)
        for opener, match in (
            ("prepare_input", r"plan entry 'model.layers.0.self_attn': 'prepare_input' on LlamaAttention converts "
             r"the first positional argument .*keywords: hidden_states, .*name the argument in the plan"),
            ("prepare_input(hidden_state)", r"plan entry 'model.layers.0.self_attn': 'prepare_input\(hidden_state\)' "
             r"on LlamaAttention converts argument 'hidden_state', but the module was called without it"),
        ):
            plan = {**LLAMA_TP_PLAN, "model.layers.*.self_attn": opener}
            model = apply_tensor_parallel(make_model(), tp_mesh, plan, config)
            with pytest.raises(TypeError, match=match):
                model(input_ids=tokens)
    finally:
        dist.destroy_process_group()


def test_the_readme_plan_is_the_tested_plan():
    readme = (Path(__file__).parents[1] / "packages/tensorparallel/README.md").read_text()
    plan = re.search(r"^LLAMA_TP_PLAN = (\{.*?^\})", readme, re.S | re.M)
    assert plan is not None, "packages/tensorparallel/README.md lost its LLAMA_TP_PLAN"
    assert ast.literal_eval(plan.group(1)) == LLAMA_TP_PLAN
