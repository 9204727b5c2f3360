"""Capacity mode's precondition: every ep rank sizes its static all-to-all blocks from the same rows.

Without `capacity_rows` the ranks compare their row counts before the first all-to-all (and again
only when the count changes): equal counts pass with one host sync per layer, unequal ones raise a
one-line error on every rank instead of hanging (NCCL) or failing inside the collective (gloo).
With `capacity_rows` the blocks are the same by construction, even for unequal row counts.
"""

import torch
from torch import nn

from plait.expertparallel import ExpertParallelConfig, apply_expert_parallel
from plait.mesh import ParallelDims, build_meshes
from plait.testing import run_on_ranks

E, D, H = 4, 8, 16


class _Experts(nn.Module):
    """Minimal experts contract; grouped groups are static in capacity mode, so a loop suffices."""

    permute_and_pad = unpermute = staticmethod(lambda *args: None)  # capacity mode never calls them

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = nn.Parameter(torch.randn(E, D, H, generator=g))

    def forward(self, x_ND, counts_E):
        w = self.w1.to_local()
        return torch.cat([x @ w[e] @ w[e].t() for e, x in enumerate(torch.split(x_ND, counts_E.tolist()))])


def _run(rank, world_size, rows_per_rank, capacity_rows, by_construction=False):
    meshes = build_meshes(ParallelDims(dp_shard=world_size, ep=world_size, world_size=world_size))
    holder = nn.Module()
    holder.experts = _Experts()
    config = ExpertParallelConfig(
        capacity_factor=2.0, capacity_rows=capacity_rows, rows_equal_by_construction=by_construction
    )
    dispatcher = apply_expert_parallel(holder, meshes.ep, ["experts"], config)["experts"]
    syncs = []
    for _ in range(2):
        n = rows_per_rank[rank]
        counts = torch.bincount(torch.arange(n) % E, minlength=E)
        x = torch.randn(n, D)[torch.argsort(torch.arange(n) % E, stable=True)]
        try:
            y = holder.experts(x, counts)
        except ValueError as e:
            return {"error": str(e)}
        assert y.shape == x.shape
        syncs.append(dispatcher.host_syncs)
    return {"syncs": syncs}


def test_equal_rows_are_checked_once_unequal_rows_raise_one_line_on_every_rank():
    for r in run_on_ranks(_run, 2, (12, 12), None, timeout=120):
        assert r == {"syncs": [1, 1]}  # checked before the first all-to-all, not again
    for r in run_on_ranks(_run, 2, (12, 8), None, timeout=120):
        assert "error" in r and "\n" not in r["error"], r
        assert "route different row counts [12, 8]" in r["error"] and "capacity_rows" in r["error"]


def test_capacity_rows_make_the_blocks_equal_by_construction():
    for r in run_on_ranks(_run, 2, (12, 8), 12, timeout=120):
        assert r == {"syncs": [0, 0]}


def test_a_caller_guaranteeing_equal_rows_skips_the_check():
    for r in run_on_ranks(_run, 2, (12, 12), None, True, timeout=120):
        assert r == {"syncs": [0, 0]}  # the trainer's case: zero host syncs in capacity mode
