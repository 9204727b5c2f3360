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

Document masking (issue 22): packed rows whose documents include a 1-token one, one exactly a
chunk long, one longer than a cp rank's share and a row that starts mid-document, with per-document
RoPE positions; every CP method at 2 and 4 ranks, both models, AC, accumulation and compile, against
the one-process document-masked run (which equals each document run alone:
packages/models/tests/test_documents.py).
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
from plait.tensorparallel import TensorParallelConfig, apply_tensor_parallel, loss_parallel_context, uses_loss_parallel
from plait.testing import run_on_ranks
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
    documents: bool = False


CP2, CP4 = dict(cp=2, dp_shard=1), dict(cp=4, dp_shard=1)


LAYOUTS_2 = {
    "llama_cp2_allgather_full_ac_accum2": Layout("llama3", dict(cp=2, dp_shard=1), accumulation=2, checkpoint="full"),
    "llama_cp2_ring_selective_ac_compile": Layout(
        "llama3", dict(cp=2, dp_shard=1), "ring", checkpoint="selective", compile=True
    ),
    "deepseek_cp2_ulysses": Layout("deepseek_v3", dict(cp=2, dp_shard=1), "ulysses"),
    "llama_cp2_ring_documents_selective_ac_compile": Layout(
        "llama3", CP2, "ring", checkpoint="selective", compile=True, documents=True
    ),
    "llama_cp2_ulysses_documents_accum2": Layout("llama3", CP2, "ulysses", accumulation=2, documents=True),
    "deepseek_cp2_allgather_documents_full_ac": Layout("deepseek_v3", CP2, checkpoint="full", documents=True),
}
LAYOUTS_4 = {
    "llama_cp4_ring": Layout("llama3", dict(cp=4, dp_shard=1), "ring"),
    "llama_cp4_ulysses_contiguous": Layout("llama3", dict(cp=4, dp_shard=1), "ulysses", load_balance=False),
    "llama_tp2_cp2_sp": Layout("llama3", dict(cp=2, tp=2, dp_shard=1), "ring"),
    "llama_tp2_cp2": Layout("llama3", dict(cp=2, tp=2, dp_shard=1), "ulysses", sequence_parallel=False),
    "llama_cp4_allgather_documents": Layout("llama3", CP4, documents=True),
    "deepseek_cp4_ring_documents": Layout("deepseek_v3", CP4, "ring", documents=True),
    "deepseek_cp4_ulysses_documents": Layout("deepseek_v3", CP4, "ulysses", documents=True),
}


def _module(name):
    return llama3 if name == "llama3" else deepseek_v3


def _args(name, documents=False):
    mask = dict(attention_mask="document", rope_positions="document") if documents else {}
    if name == "llama3":
        return dataclasses.replace(llama3.FLAVORS["debugmodel"], n_layers=2, max_seq_len=SEQ, **mask)
    return dataclasses.replace(
        deepseek_v3.FLAVORS["debugmodel"], n_layers=2, n_dense_layers=1, max_seq_len=SEQ, **mask
    )


def _seed_model(name, documents=False):
    with torch.device("meta"):
        model = _module(name).Transformer(_args(name, documents))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    return model


# Document lengths per row (SEQ 64; cp 4: a chunk is 8 tokens, a rank's share 16): a row that
# starts mid-document (offset 3), a 1-token document, exactly a chunk (8), one longer than a cp 4
# rank's share (20) and longer than a cp 2 rank's (33); rows differ so they cannot share calls.
ROWS = [(5, 1, 8, 20, 30), (33, 1, 30), (8, 8, 8, 8, 1, 31), (64,)]
FIRST_OFFSET = (3, 0, 0, 0)


def _document_positions():
    rows = []
    for lengths, offset in zip(ROWS, FIRST_OFFSET):
        pieces = [torch.arange(n) for n in lengths]
        pieces[0] = pieces[0] + offset
        rows.append(torch.cat(pieces))
    return torch.stack(rows).int()


def _batches(name):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _args(name).vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)
    batches = []
    for step, t in enumerate(tokens):
        labels = t[:, 1:].clone()
        labels[torch.rand(labels.shape, generator=g) < 0.15] = -100  # ignored labels
        documents = _document_positions().roll(step, dims=0)  # each row meets every segmentation
        batches.append((t[:, :-1], labels, documents))
    return batches


def _train(name, model, layout: Layout | None = None, meshes=None, cp_layout=None, lp=False):
    """SGD steps; returns the global token-weighted mean loss of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    dp_rank, dp = (meshes.dp_rank, meshes.dp_degree) if meshes is not None else (0, 1)
    ranks = meshes.dp_cp.size() if meshes is not None and meshes.dp_cp is not None else 1
    accumulation = layout.accumulation if layout else 1
    per = BATCH // dp
    losses = []
    documents = layout.documents if layout else model_documents(model)
    for tokens, labels, doc_positions in _batches(name):
        count = (labels != -100).sum()
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        tokens, labels, doc_positions = tokens[rows], labels[rows], doc_positions[rows]
        positions = None
        if cp_layout is not None:
            cp_rank = meshes.cp.get_local_rank()
            positions = cp_layout.local_indices(cp_rank, SEQ)
            if documents:  # per-document RoPE positions, sharded like the tokens
                positions = shard_sequence(doc_positions, 1, cp_rank, cp_layout)
            tokens, labels = shard_sequence(tokens, 1, cp_rank, cp_layout), shard_sequence(labels, 1, cp_rank, cp_layout)
        step_loss = torch.zeros(())
        micro = zip(tokens.chunk(accumulation), labels.chunk(accumulation), doc_positions.chunk(accumulation),
                    positions.chunk(accumulation) if positions is not None and positions.dim() == 2
                    else [positions] * accumulation)
        for toks, labs, docs, pos in micro:
            with loss_parallel_context(lp):
                # Attention takes the full rows' document positions (unsharded) under CP too.
                logits = model(toks, pos, docs) if documents else model(toks, pos)
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


def model_documents(model) -> bool:
    return getattr(model.args, "attention_mask", "causal") == "document"


def _full(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def _run_one(rank, world_size, layout: Layout):
    dims = ParallelDims(world_size=world_size, **layout.degrees)
    with torch.device("meta"):
        model = _module(layout.model).Transformer(_args(layout.model, layout.documents))
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
    seed = _seed_model(layout.model, layout.documents).state_dict()
    set_model_state_dict(model, seed, options=StateDictOptions(full_state_dict=True))
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
        for documents in (False, True):
            model = _seed_model(name, documents)
            out[name, documents] = dict(losses=_train(name, model), params=_full(model))
    return out


def _check(results, references, layouts):
    for rank_result in results:
        for name, layout in layouts.items():
            got, ref = rank_result[name]["losses"], references[layout.model, layout.documents]["losses"]
            assert got == pytest.approx(ref, abs=1e-5, rel=0), name
    for name, layout in layouts.items():
        ref, got = references[layout.model, layout.documents]["params"], results[0][name]["params"]
        assert set(got) == set(ref)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-4, msg=f"{name} {key}")


def test_cp_layouts_on_2_ranks(references):
    assert all(min(r["losses"][1:]) < r["losses"][0] for r in references.values())  # it trains
    _check(run_on_ranks(_run_layouts, 2, LAYOUTS_2, timeout=400), references, LAYOUTS_2)


def test_cp_with_fsdp_and_tp_on_4_ranks(references):
    _check(run_on_ranks(_run_layouts, 4, LAYOUTS_4, timeout=300), references, LAYOUTS_4)

