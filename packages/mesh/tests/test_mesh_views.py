"""Every named view has the right size and groups the right ranks, for every rank of a layout.

Both layouts are checked: the dense one (pp, dp_replicate, dp_shard, cp, tp) and, when ep > 1, the
sparse one (pp, dp_replicate, efsdp, ep, etp) that routed experts use, including how the two fit
together (ep is borrowed from dp_shard x cp, and from tp too when etp == 1).

Rank coordinates come from a fake process group (no processes: all ranks checked in one), the
real gloo groups are exercised in test_mesh_distributed.py.
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from plait.mesh import ParallelDims, build_meshes

DENSE = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
SPARSE = ("pp", "dp_replicate", "efsdp", "ep", "etp")
VIEWS = {
    "pp": (DENSE, ("pp",)),
    "dp": (DENSE, ("dp_replicate", "dp_shard")),
    "dp_shard_cp": (DENSE, ("dp_shard", "cp")),
    "dp_cp": (DENSE, ("dp_replicate", "dp_shard", "cp")),
    "cp": (DENSE, ("cp",)),
    "tp": (DENSE, ("tp",)),
    "ep": (SPARSE, ("ep",)),
    "etp": (SPARSE, ("etp",)),
    "efsdp": (SPARSE, ("efsdp",)),
}


def expected_group(dims: ParallelDims, rank: int, layout: tuple[str, ...], axes: tuple[str, ...]) -> list[int]:
    """Ranks that share every coordinate of `rank` except those on `axes` (row-major layout)."""
    sizes = [getattr(dims, a) for a in layout]
    grid = torch.arange(dims.world_size).reshape(sizes)
    coord = [int(c) for c in (grid == rank).nonzero()[0]]
    index = tuple(slice(None) if a in axes else c for a, c in zip(layout, coord))
    return sorted(grid[index].flatten().tolist())


def expected_groups(dims: ParallelDims, layout: tuple[str, ...], axes: tuple[str, ...]) -> set[tuple[int, ...]]:
    """Every group of the view over `axes`: the row-major grid with `axes` moved last, one group a row."""
    sizes = [getattr(dims, a) for a in layout]
    grid = torch.arange(dims.world_size).view(sizes)
    order = [i for i, a in enumerate(layout) if a not in axes] + [layout.index(a) for a in axes]
    group_size = 1
    for a in axes:
        group_size *= getattr(dims, a)
    rows = grid.permute(order).reshape(-1, group_size)
    return {tuple(sorted(row)) for row in rows.tolist()}


LAYOUTS = [
    dict(world_size=1),
    dict(world_size=2, dp_shard=2),
    dict(world_size=2, dp_replicate=2, dp_shard=1),
    dict(world_size=2, tp=2, dp_shard=1),
    dict(world_size=4, dp_shard=2, cp=2),
    dict(world_size=4, dp_replicate=2, dp_shard=2),
    dict(world_size=4, dp_shard=4, ep=2),
    dict(world_size=4, dp_shard=2, tp=2, ep=2, etp=2),
    dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2),
    dict(world_size=8, dp_shard=2, cp=2, tp=2),
    dict(world_size=8, dp_shard=2, cp=2, ep=4, tp=2),
    dict(world_size=8, dp_shard=2, cp=2, ep=4, tp=2, etp=2),
    dict(world_size=8, dp_replicate=2, dp_shard=4, ep=2),
    dict(world_size=8, dp_replicate=2, dp_shard=2, tp=2, ep=2),
    dict(world_size=8, dp_shard=8),
    # Pipeline parallel outermost: every other view stays inside one stage's ranks.
    dict(world_size=2, pp=2, dp_shard=1),
    dict(world_size=4, pp=2, dp_shard=2),
    dict(world_size=4, pp=4, dp_shard=1),
    dict(world_size=8, pp=2, dp_replicate=2, dp_shard=2),
    dict(world_size=8, pp=2, dp_shard=2, tp=2),
    dict(world_size=8, pp=2, dp_shard=-1, cp=2, tp=2),
    dict(world_size=8, pp=2, dp_shard=4, ep=2),
    dict(world_size=8, pp=2, dp_shard=2, tp=2, ep=2, etp=2),
    dict(world_size=8, pp=2, dp_shard=2, cp=2, ep=2),
]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda kw: "-".join(f"{k}{v}" for k, v in kw.items()))
def test_views_group_the_right_ranks(layout):
    dims = ParallelDims(**layout)
    if dims.world_size == 1:
        meshes = build_meshes(dims)
        assert all(getattr(meshes, v) is None for v in VIEWS) and meshes.dp_rank == 0
        return
    groups = {view: {} for view in VIEWS}  # view -> rank -> the ranks of its group
    for rank in range(dims.world_size):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=dims.world_size)
        try:
            meshes = build_meshes(dims)
            for view, (layout_axes, axes) in VIEWS.items():
                size = 1
                for a in axes:
                    size *= getattr(dims, a)
                mesh = getattr(meshes, view)
                if size == 1 or (layout_axes is SPARSE and dims.ep == 1):
                    assert mesh is None, view
                    continue
                assert mesh.size() == size, view
                got = sorted(dist.get_process_group_ranks(mesh.get_group()))
                assert got == expected_group(dims, rank, layout_axes, axes), (view, rank)
                groups[view][rank] = got
            expected_dp = expected_group(dims, rank, DENSE, ("dp_replicate", "dp_shard"))
            assert meshes.dp_rank == expected_dp.index(rank)
            assert meshes.pp_rank == rank // dims.stage_world_size and meshes.pp_degree == dims.pp
            _check_views_inside_stage(dims, meshes, rank)
            _check_fsdp_meshes(dims, meshes)
            _check_expert_fsdp_mesh(dims, meshes, rank)
        finally:
            dist.destroy_process_group()
    for view, by_rank in groups.items():
        if by_rank:
            layout_axes, axes = VIEWS[view]
            assert {tuple(g) for g in by_rank.values()} == expected_groups(dims, layout_axes, axes), view
    if dims.ep > 1:
        _check_sparse_fits_dense(dims, groups)


def _check_views_inside_stage(dims, meshes, rank):
    """Under pp every view but pp holds only this rank's stage, and is the pp = 1 group shifted by the stage."""
    stage_ranks = dims.stage_world_size
    stage = rank // stage_ranks
    flat = dict(dims.__dict__, pp=1, world_size=stage_ranks)
    stage_dims = ParallelDims(**flat)
    for view, (layout_axes, axes) in VIEWS.items():
        mesh = getattr(meshes, view)
        if view == "pp" or mesh is None:
            continue
        got = sorted(dist.get_process_group_ranks(mesh.get_group()))
        assert all(r // stage_ranks == stage for r in got), (view, rank)
        alone = expected_group(stage_dims, rank % stage_ranks, layout_axes, axes)
        assert got == [stage * stage_ranks + r for r in alone], (view, rank)


def _check_sparse_fits_dense(dims, groups):
    """The sparse layout re-cuts each dp_replicate slice of the dense one; ep takes whole cp (x tp) groups."""
    borrowed = ("cp", "tp") if dims.etp == 1 else ("cp",)
    for rank in range(dims.world_size):
        sparse = {view: set(groups[view].get(rank, [rank])) for view in ("efsdp", "ep", "etp")}
        dense_slice = set(expected_group(dims, rank, DENSE, ("dp_shard", "cp", "tp")))
        for view, group in sparse.items():
            assert group <= dense_slice, (view, rank)  # never crosses dp_replicate
        # efsdp x ep x etp tile the slice: pairwise they meet only at this rank, and the sizes multiply up.
        for a, b in (("efsdp", "ep"), ("efsdp", "etp"), ("ep", "etp")):
            assert sparse[a] & sparse[b] == {rank}, (a, b, rank)
        assert len(sparse["efsdp"]) * len(sparse["ep"]) * len(sparse["etp"]) == len(dense_slice)
        # ep is borrowed from dp_shard x cp (x tp when etp == 1): the rank's whole cp (x tp) group is in its ep group.
        assert set(expected_group(dims, rank, DENSE, borrowed)) <= sparse["ep"], rank
        # Expert tensor parallel, when on, is the dense tp group itself.
        if dims.etp > 1:
            assert sparse["etp"] == set(expected_group(dims, rank, DENSE, ("tp",))), rank


def _check_expert_fsdp_mesh(dims, meshes, rank):
    """Under ep, expert FSDP's (dp_replicate, efsdp) mesh is this rank's slice of the sparse grid."""
    if dims.ep == 1:
        return
    grid = torch.arange(dims.world_size).view([getattr(dims, a) for a in SPARSE])
    pp, _, _, ep, etp = (int(c) for c in (grid == rank).nonzero()[0])
    expected = grid[pp, :, :, ep, etp]
    expected = expected[tuple(slice(None) if n > 1 else 0 for n in expected.shape)]
    if expected.numel() == 1:
        assert meshes.expert_fsdp is None
    else:
        assert meshes.expert_fsdp.mesh.tolist() == expected.tolist(), rank


def _check_fsdp_meshes(dims, meshes):
    if dims.hsdp_enabled:
        assert meshes.fsdp.ndim == 2 and meshes.fsdp.shape == (dims.dp_replicate, dims.dp_shard_cp)
    elif dims.dp_shard_cp > 1 or dims.dp_replicate > 1:
        assert meshes.fsdp.ndim == 1 and meshes.fsdp.size() == max(dims.dp_shard_cp, dims.dp_replicate)
    else:
        assert meshes.fsdp is None
    if dims.ep > 1 and dims.dp_replicate > 1 and dims.efsdp > 1:
        assert meshes.expert_fsdp.shape == (dims.dp_replicate, dims.efsdp)


def test_views_are_orthogonal_and_cover_the_world():
    dims = ParallelDims(world_size=8, dp_shard=2, cp=2, tp=2, ep=4)
    dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
    try:
        meshes = build_meshes(dims)
        # the ep/efsdp/etp product and the dense product both tile the 8 ranks
        assert meshes.dp_shard_cp.size() * meshes.tp.size() == 8
        assert list(itertools.chain(meshes.dense.mesh.flatten().tolist())) == list(range(8))
        assert meshes.efsdp.size() * meshes.ep.size() == 8 and meshes.etp is None
        assert meshes.sparse.mesh_dim_names == ("efsdp", "ep")
        assert meshes.sparse.mesh.tolist() == torch.arange(8).view(2, 4).tolist()
    finally:
        dist.destroy_process_group()
