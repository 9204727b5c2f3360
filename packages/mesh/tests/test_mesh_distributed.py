"""Real gloo ranks: collectives over the views, errors on every rank, no hangs, grad-norm parity."""

import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Shard, distribute_tensor

from plait.mesh import ParallelConfigError, ParallelDims, build_meshes, clip_grad_norm_, grad_norm
from plait.testing import RankError, run_on_ranks


def _sum_over_views(rank, world_size, layout):
    meshes = build_meshes(ParallelDims(world_size=world_size, **layout))
    out = {}
    for view in ("dp", "dp_shard_cp", "dp_cp", "cp", "tp", "ep", "efsdp"):
        mesh = getattr(meshes, view)
        if mesh is None:
            continue
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mesh.get_group())
        out[view] = (sorted(dist.get_process_group_ranks(mesh.get_group())), t.item())
    return out


def test_collectives_on_views_8_ranks():
    layout = dict(dp_shard=2, cp=2, ep=4, tp=2)
    results = run_on_ranks(_sum_over_views, 8, layout, timeout=120)
    for rank, views in enumerate(results):
        assert set(views) == {"dp", "dp_shard_cp", "dp_cp", "cp", "tp", "ep", "efsdp"}
        for view, (ranks, total) in views.items():
            assert rank in ranks, view
            assert total == sum(ranks), view
    assert results[0]["tp"][0] == [0, 1] and results[0]["cp"][0] == [0, 2] and results[0]["dp"][0] == [0, 4]
    assert results[5]["ep"][0] == [4, 5, 6, 7] and results[5]["efsdp"][0] == [1, 5]


def _bad_layout(rank, world_size):
    try:
        ParallelDims(dp_shard=2, cp=2, ep=3, world_size=world_size)
    except ParallelConfigError as err:
        return str(err)
    return None


def test_invalid_layout_raises_on_every_rank():
    messages = run_on_ranks(_bad_layout, 4, timeout=60)
    assert all(m is not None and "parallelism.ep = 3" in m for m in messages)
    assert len(set(messages)) == 1


def _raise_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would wait here forever: the harness must still return
    return rank


def test_a_rank_exception_is_reraised_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 of _raise_on_rank_one raised.*ValueError: boom from rank one"):
        run_on_ranks(_raise_on_rank_one, 2, timeout=60)
    assert time.monotonic() - start < 50


def _sleep_forever(rank, world_size):
    time.sleep(3600)


def test_a_hang_fails_after_the_timeout():
    with pytest.raises(TimeoutError, match="did not finish within 5 s"):
        run_on_ranks(_sleep_forever, 2, timeout=5)


def _full_grads(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "fsdp_1d": torch.randn(8, 6, generator=g),  # sharded over all 4 ranks
        "tp_2d": torch.randn(4, 10, generator=g),  # (dp 2) x (tp 2) mesh
        "ep_1d": torch.randn(6, 3, generator=g),  # an expert weight on a 2-rank ep sub-mesh
        "plain": torch.randn(5, generator=g),  # replicated plain tensor
    }


def _grad_norm_across_meshes(rank, world_size, max_norm):
    from torch.distributed.device_mesh import init_device_mesh

    grads = _full_grads()
    world = init_device_mesh("cpu", (4,), mesh_dim_names=("world",))
    mesh_2d = world._unflatten(0, (2, 2), ("dp", "tp"))
    placements = {
        "fsdp_1d": (world, [Shard(0)]),
        "tp_2d": (mesh_2d, [Shard(0), Shard(1)]),
        "ep_1d": (mesh_2d["tp"], [Shard(0)]),
    }
    params = []
    for name, full in grads.items():
        p = torch.nn.Parameter(torch.zeros_like(full))
        p.grad = full.clone()
        if name in placements:
            mesh, pl = placements[name]
            p = torch.nn.Parameter(distribute_tensor(p.data, mesh, pl))
            p.grad = distribute_tensor(full.clone(), mesh, pl)
        params.append(p)
    norm_only = grad_norm(params).item()
    total = clip_grad_norm_(params, max_norm).item()
    clipped = [p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for p in params]
    return norm_only, total, clipped


def test_grad_norm_equals_single_process_for_mixed_meshes():
    max_norm = 1.0
    full = list(_full_grads().values())
    expected = torch.nn.utils.get_total_norm(full).item()
    ref = [g.clone() for g in full]
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, torch.tensor(expected))
    results = run_on_ranks(_grad_norm_across_meshes, 4, max_norm, timeout=120)
    for norm_only, total, clipped in results:
        assert norm_only == pytest.approx(expected, rel=1e-6)
        assert total == pytest.approx(expected, rel=1e-6)
        for got, want in zip(clipped, ref):
            torch.testing.assert_close(got, want)


def test_inf_norm_single_process():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([1.0, -7.0, 2.0])
    assert grad_norm([p], norm_type=float("inf")).item() == 7.0


def _pipeline_stage_norms(rank, world_size, max_norm):
    """pp 2 x dp_shard 2: each stage holds its own parameters, FSDP-sharded over its own 2 ranks."""
    meshes = build_meshes(ParallelDims(pp=2, dp_shard=2, world_size=world_size))
    groups = {v: sorted(dist.get_process_group_ranks(getattr(meshes, v).get_group())) for v in ("pp", "dp_shard_cp")}
    full = list(_full_grads().values())
    mine = full[:2] if meshes.pp_rank == 0 else full[2:]  # stage 0: two weights, stage 1: the other two
    params = []
    for g in mine:
        p = torch.nn.Parameter(distribute_tensor(torch.zeros_like(g), meshes.dp_shard_cp, [Shard(0)]))
        p.grad = distribute_tensor(g.clone(), meshes.dp_shard_cp, [Shard(0)])
        params.append(p)
    inf = grad_norm(params, norm_type=float("inf"), pp_mesh=meshes.pp).item()
    stage_only = grad_norm(params).item()
    total = clip_grad_norm_(params, max_norm, pp_mesh=meshes.pp).item()
    return meshes.pp_rank, groups, inf, stage_only, total, [p.grad.full_tensor() for p in params]


def test_pipeline_stages_clip_by_the_whole_models_norm():
    max_norm = 1.0
    full = list(_full_grads().values())
    expected = torch.nn.utils.get_total_norm(full).item()
    ref = [g.clone() for g in full]
    torch.nn.utils.clip_grads_with_norm_(ref, max_norm, torch.tensor(expected))
    results = run_on_ranks(_pipeline_stage_norms, 4, max_norm, timeout=120)
    for rank, (pp_rank, groups, inf, stage_only, total, clipped) in enumerate(results):
        assert pp_rank == rank // 2
        # pp is outermost: ranks 0, 1 are stage 0; the pp group pairs the same place in each stage.
        assert groups == {"pp": [rank % 2, rank % 2 + 2], "dp_shard_cp": [rank - rank % 2, rank - rank % 2 + 1]}
        assert inf == max(g.abs().max().item() for g in full)
        assert stage_only < expected  # without pp_mesh a stage sees only its share
        assert total == pytest.approx(expected, rel=1e-6)
        for got, want in zip(clipped, ref[:2] if pp_rank == 0 else ref[2:]):
            torch.testing.assert_close(got, want)
