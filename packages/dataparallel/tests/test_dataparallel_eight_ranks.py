"""8 ranks: FSDP over 8 and HSDP 2x4, parity and 1/N sharded bytes; HSDP with experts on a 2D
(replicate, efsdp) mesh. One spawn serves every test here."""

import pytest
import torch.distributed as dist
from dataparallel_harness import (
    BLOCKS,
    EXPERTS,
    assert_parity,
    assert_sharded_bytes,
    build_model,
    full_params,
    local_param_bytes,
    reference,
    train,
)
from torch.distributed.tensor import Replicate, Shard

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

TIMEOUT = 300


def _case(meshes, n_experts=0, experts=(), after_backward=None):
    model = apply_data_parallel(build_model(n_experts), meshes, BLOCKS, DataParallelConfig(), experts)
    grads = {}
    losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), after_backward, first_grads=grads)
    mesh_shape = tuple(next(model.parameters()).device_mesh.shape)
    out = dict(losses=losses, grads=grads, params=full_params(model), bytes=local_param_bytes(model), mesh=mesh_shape)
    if experts:
        w1 = model.get_submodule(experts[0]).w1
        out["expert"] = (tuple(w1.device_mesh.shape), tuple(w1.placements))
    return out


def _cases(rank, world_size):
    moe = build_meshes(ParallelDims(dp_replicate=2, dp_shard=4, ep=2, world_size=world_size))

    def sum_over_ep(model):  # what EP's token exchange would add (no real EP in this test)
        for p in model.get_submodule(EXPERTS[0]).parameters():
            dist.all_reduce(p.grad.to_local(), group=moe.ep.get_group())

    return {
        "fsdp": _case(build_meshes(ParallelDims(dp_shard=8, world_size=world_size))),
        "hsdp": _case(build_meshes(ParallelDims(dp_replicate=2, dp_shard=4, world_size=world_size))),
        "hsdp_experts": _case(moe, 1, EXPERTS, sum_over_ep),
    }


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_cases, 8, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("case, mesh, shards", [("fsdp", (8,), 8), ("hsdp", (2, 4), 4)])
def test_parity_and_bytes_on_eight_ranks(results, ref, case, mesh, shards):
    for rank_result in results:
        got = rank_result[case]
        assert got["mesh"] == mesh
        assert_parity(got, ref)
        assert_sharded_bytes(got["bytes"], ref, shards)


def test_hsdp_with_experts_on_a_2d_expert_mesh(results):
    ref = reference(n_experts=1)
    for rank_result in results:
        got = rank_result["hsdp_experts"]
        assert got["expert"] == ((2, 2), (Replicate(), Shard(1)))  # one local expert, 2 efsdp ranks
        assert_parity(got, ref)
