"""plait.tensorparallel (+ plait.dataparallel) x plait.models: the Llama 3 and DeepSeek-V3 debug
models (2 layers, seq 64) under TP 4 with and without sequence and loss parallel, TP 2 with
sequence or loss parallel alone, and FSDP 2 x TP 2 (with the sequence-wise aux loss too) reproduce
the single-process run step for step, through the packages' own APIs. (TP 2 / FSDP x TP / HSDP x TP
through the trainer, both models, fp32 and bf16: the parity matrix.)

The trainer's flow: build on meta, tensor parallel from the model's own plan, data parallel by its
blocks, `to_empty`, `init_weights()` (RoPE buffers), then load the seed checkpoint: the full state
dict of a single-process model initialised from a fixed seed. One 4-rank spawn runs every layout
in turn, each on fresh meshes.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes, clip_grad_norm_
from plait.models.moe import configure_moe_aux_loss
from plait.tensorparallel import (
    TensorParallelConfig,
    apply_tensor_parallel,
    loss_parallel_context,
    uses_loss_parallel,
    validate_tensor_parallel,
)
from plait.testing import run_on_ranks

llama3 = pytest.importorskip("plait.models.llama3")
deepseek_v3 = pytest.importorskip("plait.models.deepseek_v3")

BATCH, SEQ, STEPS, LR, MAX_NORM = 4, 64, 5, 0.1, 1.0
MODELS = ("llama3", "deepseek_v3")
AUX_MODEL = "deepseek_v3_aux"  # DeepSeek-V3 with the sequence-wise aux loss, on the layouts below
AUX_LAYOUTS = ("tp4_sp_lp", "tp2_sp", "fsdp2_tp2_sp_lp")

# name -> (ParallelDims degrees, sequence_parallel, loss_parallel, data parallel). TP 2 on 4 ranks
# fills the world with dp_shard = 2 but applies no data parallel: every rank sees the whole batch.
LAYOUTS_4 = {
    "tp4_sp_lp": (dict(tp=4, dp_shard=1), True, True, False),
    "tp4": (dict(tp=4, dp_shard=1), False, False, False),
    "tp2_sp": (dict(tp=2, dp_shard=2), True, False, False),
    "tp2_lp": (dict(tp=2, dp_shard=2), False, True, False),
    "fsdp2_tp2_sp_lp": (dict(tp=2, dp_shard=2), True, True, True),
}


def _args(name: str):
    if name == "llama3":
        return dataclasses.replace(llama3.FLAVORS["debugmodel"], n_layers=2, max_seq_len=SEQ)
    # One dense block, one MoE block; "deepseek_v3_aux" adds the sequence-wise aux loss.
    aux = 0.01 if name == "deepseek_v3_aux" else 0.0
    return dataclasses.replace(
        deepseek_v3.FLAVORS["debugmodel"], n_layers=2, n_dense_layers=1, max_seq_len=SEQ, aux_loss_coeff=aux
    )


def _module(name: str):
    return llama3 if name == "llama3" else deepseek_v3


def _seed_model(name: str):
    with torch.device("meta"):
        model = _module(name).Transformer(_args(name))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    return model


def tp_plan(info: dict) -> dict:
    """The model's plan as declared (routed experts TP-sharded: no expert parallel in these layouts)."""
    return dict(info["tp_plan"])


def _batches(name: str):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _args(name).vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(name, model, loss_parallel=False, dp_rank=0, dp_degree=1, dp_group=None, tp=1):
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    per = BATCH // dp_degree
    if name == AUX_MODEL:
        # The aux loss trains inside its MoE block's backward. Every TP rank computes it inside the
        # MoE's TP region, whose entry sums the ranks' gradients: each rank weighs it 1/tp (what
        # the trainer does).
        configure_moe_aux_loss(model, grad_scale=1 / tp)
    losses = []
    for tokens, labels in _batches(name):
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        with loss_parallel_context(loss_parallel):
            logits = model(tokens[rows])
            loss = F.cross_entropy(logits.float().flatten(0, 1), labels[rows].flatten())
            loss.backward()
        clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / dp_degree
        losses.append(loss.item())
    return losses


def _full(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def _run_one(rank, world_size, name, degrees, sp, lp, data_parallel):
    dims = ParallelDims(world_size=world_size, **degrees)
    config = TensorParallelConfig(sequence_parallel=sp, loss_parallel=lp)
    with torch.device("meta"):
        model = _module(name).Transformer(_args(name))
    info = model.parallel_info()
    plan = tp_plan(info)
    validate_tensor_parallel(info, dims.tp, SEQ, config)
    meshes = build_meshes(dims)
    model = apply_tensor_parallel(model, meshes.tp, plan, config)
    if data_parallel:
        model = apply_data_parallel(model, meshes, info["blocks"], DataParallelConfig())
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    set_model_state_dict(model, _seed_model(name).state_dict(), options=StateDictOptions(full_state_dict=True))
    lp_on = uses_loss_parallel(plan, config, dims.tp)
    if data_parallel:
        losses = _train(name, model, lp_on, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), tp=dims.tp)
    else:
        losses = _train(name, model, lp_on, tp=dims.tp)
    params = _full(model)
    return dict(losses=losses, params=params if rank == 0 else None)


def _runs(layouts):
    """(model, layout) pairs: both models on every layout, the aux-loss model on AUX_LAYOUTS."""
    pairs = [(name, layout) for name in MODELS for layout in layouts]
    return pairs + [(AUX_MODEL, layout) for layout in layouts if layout in AUX_LAYOUTS]


def _run_layouts(rank, world_size, layouts):
    torch.manual_seed(1234)
    return {(name, layout): _run_one(rank, world_size, name, *layouts[layout]) for name, layout in _runs(layouts)}


@pytest.fixture(scope="module")
def references():
    out = {}
    for name in (*MODELS, AUX_MODEL):
        model = _seed_model(name)
        out[name] = dict(losses=_train(name, model), params=_full(model))
    return out


def _check(results, references, layouts):
    for rank_result in results:
        for name, layout in _runs(layouts):
            ref = references[name]
            got = rank_result[name, layout]
            assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5), (name, layout)
    for name, layout in _runs(layouts):
        ref, got = references[name]["params"], results[0][name, layout]["params"]
        assert set(got) == set(ref)
        for key in ref:
            torch.testing.assert_close(got[key], ref[key], atol=1e-5, rtol=1e-4, msg=f"{name} {layout} {key}")


def test_tp_layouts_on_4_ranks(references):
    assert all(r["losses"][-1] < r["losses"][0] for r in references.values())
    results = run_on_ranks(_run_layouts, 4, LAYOUTS_4, timeout=300)
    _check(results, references, LAYOUTS_4)

