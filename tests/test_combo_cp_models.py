"""plait.contextparallel x models (+ data, tensor parallel, activation checkpointing, compile):
training with the sequence sharded over cp ranks reproduces the single-process run step for step.

What the parity matrix (test_combo_parity_matrix.py: CP 2 with each method and without load
balancing, FSDP 2 x CP 2, TP 2 x CP 2 all-gather, HSDP 2x2 x CP 2, both models, through the
trainer) does not cover, here through the packages' own APIs. Llama 3 debug (2 layers, seq 64):
CP 2 with full / selective activation checkpointing, gradient accumulation and compile; CP 4 ring
and Ulysses without load balancing; TP 2 x CP 2 ring with sequence parallel and Ulysses without.
DeepSeek-V3 debug (MLA: q/k head dim 192, v 128; one dense and one MoE block): CP 2 Ulysses.
Every batch has ignored labels (-100): the loss is the sum over valid tokens divided by their
global count, as the trainer computes it. One spawn per world size runs its layouts in turn.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from plait.contextparallel import (
    ContextParallelConfig,
    apply_context_parallel,
    shard_sequence,
    validate_context_parallel,
)
from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes, clip_grad_norm_
from plait.mesh.testing import run_on_ranks
from plait.tensorparallel import TensorParallelConfig, apply_tensor_parallel, loss_parallel_context, uses_loss_parallel
from plait.trainer.activation_checkpoint import apply_activation_checkpointing

llama3 = pytest.importorskip("plait.models.llama3")
deepseek_v3 = pytest.importorskip("plait.models.deepseek_v3")

BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 64, 5, 0.1, 1.0


@dataclasses.dataclass(frozen=True)
class Layout:
    model: str
    degrees: dict
    method: str = "allgather"
    load_balance: bool = True
    sequence_parallel: bool = True
    accumulation: int = 1
    checkpoint: str = "none"
    compile: bool = False


LAYOUTS_2 = {
    "llama_cp2_allgather_full_ac_accum2": Layout("llama3", dict(cp=2, dp_shard=1), accumulation=2, checkpoint="full"),
    "llama_cp2_ring_selective_ac_compile": Layout(
        "llama3", dict(cp=2, dp_shard=1), "ring", checkpoint="selective", compile=True
    ),
    "deepseek_cp2_ulysses": Layout("deepseek_v3", dict(cp=2, dp_shard=1), "ulysses"),
}
LAYOUTS_4 = {
    "llama_cp4_ring": Layout("llama3", dict(cp=4, dp_shard=1), "ring"),
    "llama_cp4_ulysses_contiguous": Layout("llama3", dict(cp=4, dp_shard=1), "ulysses", load_balance=False),
    "llama_tp2_cp2_sp": Layout("llama3", dict(cp=2, tp=2, dp_shard=1), "ring"),
    "llama_tp2_cp2": Layout("llama3", dict(cp=2, tp=2, dp_shard=1), "ulysses", sequence_parallel=False),
}


def _module(name):
    return llama3 if name == "llama3" else deepseek_v3


def _args(name):
    if name == "llama3":
        return dataclasses.replace(llama3.FLAVORS["debugmodel"], n_layers=2, max_seq_len=SEQ)
    return dataclasses.replace(deepseek_v3.FLAVORS["debugmodel"], n_layers=2, n_dense_layers=1, max_seq_len=SEQ)


def _seed_model(name):
    with torch.device("meta"):
        model = _module(name).Transformer(_args(name))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    return model


def _batches(name):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _args(name).vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)
    batches = []
    for t in tokens:
        labels = t[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.15] = -100  # ignored labels
        batches.append((t[:, :-1], labels))
    return batches


def _train(name, model, layout: Layout | None = None, meshes=None, cp_layout=None, lp=False):
    """SGD steps; returns the global token-weighted mean loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dp_rank, dp = (meshes.dp_rank, meshes.dp_degree) if meshes is not None else (0, 1)
    ranks = meshes.dp_cp.size() if meshes is not None and meshes.dp_cp is not None else 1
    accumulation = layout.accumulation if layout else 1
    per = BATCH // dp
    losses = []
    for tokens, labels in _batches(name):
        count = (labels != -100).sum()
        tokens, labels = tokens[dp_rank * per:(dp_rank + 1) * per], labels[dp_rank * per:(dp_rank + 1) * per]
        positions = None
        if cp_layout is not None:
            cp_rank = meshes.cp.get_local_rank()
            positions = cp_layout.local_indices(cp_rank, SEQ)
            tokens, labels = shard_sequence(tokens, 1, cp_rank, cp_layout), shard_sequence(labels, 1, cp_rank, cp_layout)
        step_loss = torch.zeros(())
        for toks, labs in zip(tokens.chunk(accumulation), labels.chunk(accumulation)):
            with loss_parallel_context(lp):
                logits = model(toks, positions)
                loss = F.cross_entropy(logits.float().flatten(0, 1), labs.flatten(), ignore_index=-100, reduction="sum")
                (loss * ranks / count).backward()
            loss = loss.detach()
            step_loss += loss.full_tensor() if isinstance(loss, DTensor) else loss
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        if meshes is not None and meshes.dp_cp is not None:
            dist.all_reduce(step_loss, group=meshes.dp_cp.get_group())
        losses.append((step_loss / count).item())
    return losses


def _full(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def _run_one(rank, world_size, layout: Layout):
    dims = ParallelDims(world_size=world_size, **layout.degrees)
    with torch.device("meta"):
        model = _module(layout.model).Transformer(_args(layout.model))
    info = model.parallel_info()
    cp_config = ContextParallelConfig(layout.method, layout.load_balance)
    validate_context_parallel(info, dims.cp, SEQ, cp_config, dims.tp)
    meshes = build_meshes(dims)
    lp = False
    if dims.tp > 1:
        tp_config = TensorParallelConfig(sequence_parallel=layout.sequence_parallel, loss_parallel=True)
        model = apply_tensor_parallel(model, meshes.tp, info["tp_plan"], tp_config)
        lp = uses_loss_parallel(info["tp_plan"], tp_config, dims.tp)
    cp_layout = apply_context_parallel(model, meshes.cp, info["attention_modules"], cp_config)
    apply_activation_checkpointing(model, info["blocks"], layout.checkpoint)
    if layout.compile:
        for path in info["blocks"]:
            model.get_submodule(path).compile()
    model = apply_data_parallel(model, meshes, info["blocks"], DataParallelConfig())
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    set_model_state_dict(model, _seed_model(layout.model).state_dict(), options=StateDictOptions(full_state_dict=True))
    losses = _train(layout.model, model, layout, meshes, cp_layout, lp)
    params = _full(model)  # a collective: every rank gathers
    return dict(losses=losses, params=params if rank == 0 else None)


def _run_layouts(rank, world_size, layouts):
    torch.manual_seed(1234)
    return {name: _run_one(rank, world_size, layout) for name, layout in layouts.items()}


@pytest.fixture(scope="module")
def references():
    out = {}
    for name in ("llama3", "deepseek_v3"):
        model = _seed_model(name)
        out[name] = dict(losses=_train(name, model), params=_full(model))
    return out


def _check(results, references, layouts):
    for rank_result in results:
        for name, layout in layouts.items():
            got, ref = rank_result[name]["losses"], references[layout.model]["losses"]
            assert got == pytest.approx(ref, abs=1e-5, rel=0), name
    for name, layout in layouts.items():
        ref, got = references[layout.model]["params"], results[0][name]["params"]
        assert set(got) == set(ref)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-4, msg=f"{name} {key}")


def test_cp_layouts_on_2_ranks(references):
    assert all(min(r["losses"][1:]) < r["losses"][0] for r in references.values())  # it trains
    _check(run_on_ranks(_run_layouts, 2, LAYOUTS_2, timeout=400), references, LAYOUTS_2)


def test_cp_with_fsdp_and_tp_on_4_ranks(references):
    _check(run_on_ranks(_run_layouts, 4, LAYOUTS_4, timeout=300), references, LAYOUTS_4)

