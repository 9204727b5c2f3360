"""plait.dataparallel x plait.models: the Llama 3 debug model (2 layers, seq 64) under FSDP over 2
ranks and HSDP 2x2 reproduces the single-process run step for step.

The trainer's flow: build on meta, apply data parallel by the model's own `parallel_info()`
blocks, `to_empty`, `init_weights()` (for the RoPE buffers), then load the seed checkpoint, the
full state dict of a single-process model initialised from a fixed seed.
"""

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.tensor import DTensor

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

llama3 = pytest.importorskip("plait.models.llama3")

BATCH, SEQ, STEPS, LR = 4, 64, 3, 1e-3
TIMEOUT = 300


def _args():
    return dataclasses.replace(llama3.FLAVORS["debugmodel"], n_layers=2, max_seq_len=SEQ)


def _seed_model():
    with torch.device("meta"):
        model = llama3.Transformer(_args())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights(buffer_device="cpu")
    return model


def _batches():
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, _args().vocab_size, (STEPS, BATCH, SEQ + 1), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def _train(model, dp_rank=0, dp_degree=1, dp_group=None):
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    per = BATCH // dp_degree
    losses = []
    for tokens, labels in _batches():
        rows = slice(dp_rank * per, (dp_rank + 1) * per)
        logits = model(tokens[rows])
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels[rows].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        loss = loss.detach()
        if dp_group is not None:
            dist.all_reduce(loss, group=dp_group)
            loss = loss / dp_degree
        losses.append(loss.item())
    return losses


def _full(model):
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach() for k, v in model.state_dict().items()}


def _parallel(rank, world_size, degrees):
    meshes = build_meshes(ParallelDims(world_size=world_size, **degrees))
    with torch.device("meta"):
        model = llama3.Transformer(_args())
    info = model.parallel_info()
    # As the trainer does: the embedding and the output head are FSDP units of their own.
    model = apply_data_parallel(model, meshes, info["blocks"], DataParallelConfig(), edge_units=info["edge_units"])
    model.to_empty(device="cpu")
    model.init_weights(buffer_device="cpu")
    set_model_state_dict(model, _seed_model().state_dict(), options=StateDictOptions(full_state_dict=True))
    losses = _train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group())
    params = _full(model)
    return dict(losses=losses, params=params if rank == 0 else None, gathered=_gathered_between(model))


def _gathered_between(model):
    """Which edge weights FSDP holds unsharded (plain tensors) between forward and backward."""
    tokens, _ = _batches()[0]
    logits = model(tokens[:1])
    held = {name: not isinstance(model.get_submodule(name).weight, DTensor) for name in ("tok_embeddings", "output")}
    logits.sum().backward()
    model.zero_grad()
    return held


@pytest.fixture(scope="module")
def ref():
    model = _seed_model()
    return dict(losses=_train(model), params=_full(model))


@pytest.mark.parametrize(
    "world_size, degrees",
    [(2, dict(dp_shard=2)), (4, dict(dp_replicate=2, dp_shard=2))],
    ids=["fsdp2", "hsdp2x2"],
)
def test_llama3_data_parallel_parity(ref, world_size, degrees):
    results = run_on_ranks(_parallel, world_size, degrees, timeout=TIMEOUT)
    for got in results:
        assert got["losses"] == pytest.approx(ref["losses"], abs=1e-5, rel=1e-6)
        # The embedding is resharded as soon as it has run; the head stays gathered for backward
        # (a root unit would hold both for the whole step).
        assert got["gathered"] == {"tok_embeddings": False, "output": True}
    params = results[0]["params"]
    assert params.keys() == ref["params"].keys()
    for name, value in ref["params"].items():
        torch.testing.assert_close(params[name], value, atol=1e-5, rtol=1e-4, msg=name)
