"""4 ranks: FSDP (and reshard to groups of 2), HSDP 2x2, replicate, FSDP over tensor-parallel DTensors,
and routed experts sharded over a smaller mesh than the rest. One spawn serves every test here.
"""

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
    reshard_after_forward_of,
    train,
)
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from plait.dataparallel import DataParallelConfig, apply_data_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

TIMEOUT = 300


def _run(meshes, config, model=None, expert_modules=(), after_backward=None):
    model = model if model is not None else build_model()
    model = apply_data_parallel(model, meshes, BLOCKS, config, expert_modules)
    grads = {}
    losses = train(model, meshes.dp_rank, meshes.dp_degree, meshes.dp.get_group(), after_backward, first_grads=grads)
    model.first_grads = grads
    return model, losses


def _summary(model, losses, **extra):
    return dict(
        losses=losses, params=full_params(model), grads=model.first_grads, bytes=local_param_bytes(model), **extra
    )


def _cases(rank, world_size):
    out = {}
    fsdp = build_meshes(ParallelDims(dp_shard=4, world_size=world_size))
    model, losses = _run(fsdp, DataParallelConfig())
    out["fsdp"] = _summary(model, losses, reshard=reshard_after_forward_of(model))
    model, losses = _run(fsdp, DataParallelConfig(reshard_after_forward=2))
    out["fsdp_int"] = dict(losses=losses, reshard=reshard_after_forward_of(model))

    hsdp = build_meshes(ParallelDims(dp_replicate=2, dp_shard=2, world_size=world_size))
    model, losses = _run(hsdp, DataParallelConfig())
    out["hsdp"] = _summary(model, losses, mesh_shape=tuple(next(model.parameters()).device_mesh.shape))

    rep = build_meshes(ParallelDims(dp_replicate=4, dp_shard=1, world_size=world_size))
    model, losses = _run(rep, DataParallelConfig())
    out["replicate"] = _summary(model, losses)

    out["fsdp_tp"] = _fsdp_over_tp(world_size)
    out["experts"] = _experts_on_a_smaller_mesh(world_size)
    out["experts_hsdp"] = _experts_replicated_under_hsdp(world_size)
    return out


def _fsdp_over_tp(world_size):
    """Blocks' linears are already DTensors on the tp mesh; FSDP adds the dp_shard axis."""
    meshes = build_meshes(ParallelDims(dp_shard=2, tp=2, world_size=world_size))
    model = build_model()
    for block in model.layers:
        parallelize_module(block, meshes.tp, {"w1": ColwiseParallel(), "w2": RowwiseParallel()})
    model, losses = _run(meshes, DataParallelConfig(), model)
    w1 = model.layers[0].w1.weight
    return _summary(model, losses, w1=(w1.device_mesh.mesh_dim_names, tuple(w1.placements)))


def _experts_on_a_smaller_mesh(world_size):
    """dp_shard 4, ep 2: experts FSDP-sharded over efsdp (2 ranks), the rest over dp_shard (4 ranks).

    There is no real expert parallel here (every rank holds the one expert), so the test adds what
    EP's token exchange would: the experts' gradients summed over the ep axis. With one local expert
    and 2 efsdp ranks, the expert weights [1, in, out] are sharded on dim 1.
    """
    meshes = build_meshes(ParallelDims(dp_shard=4, ep=2, world_size=world_size))

    def sum_over_ep(model):
        for p in model.get_submodule(EXPERTS[0]).parameters():
            dist.all_reduce(p.grad.to_local(), group=meshes.ep.get_group())

    model, losses = _run(
        meshes, DataParallelConfig(prefetch=True), build_model(n_experts=1), EXPERTS, after_backward=sum_over_ep
    )
    expert_w1, dense_w1 = model.layers[1].experts.w1, model.layers[1].w1.weight
    return _summary(
        model,
        losses,
        expert=(expert_w1.device_mesh.size(), tuple(expert_w1.placements), tuple(expert_w1.to_local().shape)),
        dense=(dense_w1.device_mesh.size(), tuple(dense_w1.placements)),
    )


def _experts_replicated_under_hsdp(world_size):
    """dp_replicate 2, dp_shard 2, ep 2: ep takes all of dp_shard (efsdp 1), so experts are
    replicated over dp_replicate (not sharded over it) while the rest is HSDP 2x2."""
    meshes = build_meshes(ParallelDims(dp_replicate=2, dp_shard=2, ep=2, world_size=world_size))

    def sum_over_ep(model):
        for p in model.get_submodule(EXPERTS[0]).parameters():
            dist.all_reduce(p.grad.to_local(), group=meshes.ep.get_group())

    model, losses = _run(meshes, DataParallelConfig(), build_model(n_experts=1), EXPERTS, after_backward=sum_over_ep)
    expert_w1, dense_w1 = model.layers[1].experts.w1, model.layers[1].w1.weight
    return _summary(
        model,
        losses,
        expert=(tuple(expert_w1.device_mesh.shape), tuple(expert_w1.placements)),
        dense=(tuple(dense_w1.device_mesh.shape), tuple(dense_w1.placements)),
    )


@pytest.fixture(scope="module")
def results():
    return run_on_ranks(_cases, 4, timeout=TIMEOUT)


@pytest.fixture(scope="module")
def ref():
    return reference()


# fsdp_tp: only the blocks' linears are tensor-parallel, so there is no single fraction to check.
@pytest.mark.parametrize("case, shards", [("fsdp", 4), ("hsdp", 2), ("replicate", 1), ("fsdp_tp", None)])
def test_parity_and_bytes(results, ref, case, shards):
    for rank_result in results:
        assert_parity(rank_result[case], ref)
        if shards is not None:
            assert_sharded_bytes(rank_result[case]["bytes"], ref, shards)


def test_hsdp_uses_the_2d_mesh(results):
    assert results[0]["hsdp"]["mesh_shape"] == (2, 2)


def test_fsdp_composes_with_tensor_parallel_dtensors(results):
    names, placements = results[0]["fsdp_tp"]["w1"]
    assert "tp" in names and len(placements) == 2  # (dp_shard, tp)


def test_reshard_policies_on_four_ranks(results, ref):
    assert results[0]["fsdp"]["reshard"] == {"layers.0": True, "layers.1": True, "layers.2": False, "": False}
    assert results[0]["fsdp_int"]["reshard"] == {name: 2 for name in [*BLOCKS, ""]}
    assert_parity(results[0]["fsdp_int"], ref, params=False)


def test_experts_on_a_smaller_mesh(results):
    ref = reference(n_experts=1)
    for rank_result in results:
        got = rank_result["experts"]
        assert got["expert"] == (2, (Shard(1),), (1, 8, 32))  # [E=1, in/2, out] on the 2-rank expert mesh
        assert got["dense"] == (4, (Shard(0),))
        assert_parity(got, ref)


def test_experts_replicated_when_ep_takes_all_of_dp_shard(results):
    ref = reference(n_experts=1)
    for rank_result in results:
        got = rank_result["experts_hsdp"]
        assert got["expert"] == ((2,), (Replicate(),))
        assert got["dense"] == ((2, 2), (Replicate(), Shard(0)))
        assert_parity(got, ref)
