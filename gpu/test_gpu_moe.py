"""MoE and expert parallel: every CUDA-only branch of plait.models.moe and plait.expertparallel
against its CPU / per-expert-matmul reference on the same inputs.

CUDA-only branches (grep device.type / is_cuda / cuda / triton):
- models/moe/experts.py:_grouped_mm -- torch._grouped_mm's CUTLASS kernel (bf16, sm90/sm100);
  `_grouped_mm_sync_free` (Triton, moe/triton_grouped_mm.py) for fp32 and bf16 below Hopper,
  where torch's fallback would read `offs` on the host on every call.
- models/moe/experts.py:_equal_groups_as_bmm -- capacity mode's equal groups: grouped_mm on CUDA,
  a batched matmul on the CPU.
- models/moe/kernels.py:generate_permute_indices -- the Triton permute kernel (triton_kernels.py).
- expertparallel dispatch / combine -- NCCL uneven all_to_all_single; the experts' gradient
  reduction over their FSDP mesh with a divide factor (PREMUL_SUM on NCCL, SUM then divide on gloo).
In the CPU dry run everything not marked cuda_only runs on the CPU (gloo), without sync checks.
bf16 tolerance: 2e-2 relative to the reference's largest magnitude (bf16 keeps 8 bits of
mantissa, ~4e-3 per rounding; a few roundings along the SwiGLU chain).
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from gpu_helpers import CudaSyncs
from torch import nn

from plait.models.moe import GroupedExperts, MoE, TokenChoiceTopKRouter
from plait.models.moe.experts import run_experts_for_loop
from plait.models.moe.kernels import GROUP_ALIGNMENT, permute_indices_torch

DIM, HIDDEN, E = 64, 96, 8
BF16_TOL = 2e-2


def _close(got: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    got, ref = got.detach().float().cpu(), ref.detach().float().cpu()
    scale = float(ref.abs().max()) or 1.0
    err = float((got - ref).abs().max())
    assert err <= tol * scale, f"{what}: max error {err:.3e} > {tol} x {scale:.3e}"


def _experts_case(device, dtype, counts=(5, 0, 40, 1, 0, 17, 3, 9)):
    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, E)
    experts.init_weights(0.3)
    counts_E = torch.tensor(counts)
    x = torch.randn(int(counts_E.sum()), DIM)
    dy = torch.randn(int(counts_E.sum()), DIM)
    # Reference: per-expert fp32 matmuls on the CPU.
    xr = x.clone().requires_grad_()
    w_ref = [p.detach().clone().requires_grad_() for p in (experts.w1, experts.w2, experts.w3)]
    y_ref = run_experts_for_loop(*w_ref, xr, counts_E)
    y_ref.backward(dy)
    experts.to(device=device, dtype=dtype)
    xd = x.to(device, dtype).requires_grad_()
    return experts, xd, counts_E.to(device), dy.to(device, dtype), (y_ref, xr.grad, *(w.grad for w in w_ref))


def _run_and_check(experts, xd, counts, dy, ref, tol, what):
    y = experts(xd, counts)
    y.backward(dy)
    got = (y, xd.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad)
    for name, g, r in zip(("y", "dx", "dw1", "dw2", "dw3"), got, ref):
        _close(g, r, tol, f"{what} {name}")


def test_grouped_mm_bf16_matches_per_expert_matmuls(device):
    """CUDA branch: models/moe/experts.py:_grouped_mm -- torch._grouped_mm in bf16 (CUTLASS on
    sm90/sm100, the Triton kernel below) with groups padded to the rule (ep = 1), forward and
    backward, against per-expert fp32 matmuls; empty experts included."""
    experts, xd, counts, dy, ref = _experts_case(device, torch.bfloat16)
    _run_and_check(experts, xd, counts, dy, ref, BF16_TOL, "bf16")


def test_fp32_experts_run_without_host_sync(device):
    """CUDA branch: models/moe/experts.py:_grouped_mm_sync_free -- fp32 experts on CUDA (where
    torch's _grouped_mm falls back to a host loop reading offs) run the Triton grouped GEMM, forward
    and backward, under set_sync_debug_mode("error"), and match fp32 per-expert matmuls."""
    experts, xd, counts, dy, ref = _experts_case(device, torch.float32)
    with CudaSyncs(device, "error"):
        y = experts(xd, counts)
        y.backward(dy)
    got = (y, xd.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad)
    for name, g, r in zip(("y", "dx", "dw1", "dw2", "dw3"), got, ref):
        _close(g, r, 1e-4, f"fp32 {name}")


def test_equal_groups_match_per_expert_matmuls(device):
    """Device branch: models/moe/experts.py:_equal_groups_as_bmm -- capacity mode's `group_rows`
    (every expert 16 rows): CUDA keeps grouped_mm, the CPU dry run takes the batched matmul;
    forward and backward in bf16 against per-expert fp32 matmuls."""
    experts, xd, counts, dy, ref = _experts_case(device, torch.bfloat16, counts=(16,) * E)
    experts.pad_groups = False  # as expert parallel sets it
    y = experts(xd, counts, group_rows=16)
    y.backward(dy)
    got = (y, xd.grad, experts.w1.grad, experts.w2.grad, experts.w3.grad)
    for name, g, r in zip(("y", "dx", "dw1", "dw2", "dw3"), got, ref):
        _close(g, r, BF16_TOL, f"equal groups {name}")


@pytest.mark.cuda_only
def test_triton_grouped_mm_bf16_matches_torch_grouped_mm(device):
    """CUDA branch: models/moe/triton_grouped_mm.py (bf16, the path below Hopper) -- against
    torch._grouped_mm on the same bf16 inputs, forward and backward."""
    from plait.models.moe.triton_grouped_mm import triton_grouped_mm

    torch.manual_seed(0)
    offs = torch.tensor([8, 8, 56, 64, 128], dtype=torch.int32, device=device)
    x = torch.randn(128, DIM, device=device, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(5, DIM, HIDDEN, device=device, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(128, HIDDEN, device=device, dtype=torch.bfloat16)
    y = triton_grouped_mm(x, w, offs)
    y.backward(dy)
    x2, w2 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ref = torch.cat([x2[a:b] @ w2[g] for g, (a, b) in enumerate(zip([0, 8, 8, 56, 64], offs.tolist()))])
    ref.backward(dy.float())
    for name, g, r in (("y", y, ref), ("dx", x.grad, x2.grad), ("dw", w.grad, w2.grad)):
        _close(g, r, BF16_TOL, f"triton bf16 {name}")


@pytest.mark.cuda_only
def test_triton_permute_kernel_compiled_matches_torch(device):
    """CUDA branch: models/moe/kernels.py:generate_permute_indices -> triton_kernels.py (compiled)
    -- the same layout as the torch version for random counts with zeros, several ep x experts."""
    from plait.models.moe.triton_kernels import permute_indices_triton

    g = torch.Generator().manual_seed(0)
    for ep, local in ((1, 8), (2, 4), (4, 2), (8, 16), (3, 5)):
        for _ in range(4):
            counts = torch.randint(0, 50, (ep * local,), generator=g)
            counts[torch.randint(0, ep * local, (ep * local // 3 + 1,), generator=g)] = 0
            max_len = int(counts.sum()) + local * GROUP_ALIGNMENT + 5
            got = permute_indices_triton(counts.to(device), ep, local, max_len, GROUP_ALIGNMENT)
            ref = permute_indices_torch(counts.to(device), ep, local, max_len, GROUP_ALIGNMENT)
            for a, b in zip(got, ref):
                assert a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu()), (ep, local, counts.tolist())


def test_uneven_all_to_all_single_one_rank(device, one_rank_mesh):
    """CUDA branch: expertparallel/dispatch.py (NCCL all_to_all_single with split sizes, autograd)
    -- on a 1-rank group the uneven exchange is the identity, forward and backward."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    x = torch.randn(13, DIM, device=device, requires_grad=True)
    y = all_to_all_single_autograd(x, [13], [13], one_rank_mesh.get_group())
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(y.detach(), x.detach()) and torch.equal(x.grad, torch.full_like(x, 2.0))


def _moe_block(device, dtype):
    torch.manual_seed(0)
    holder = nn.Module()
    holder.moe = MoE(DIM, HIDDEN, E, 1, TokenChoiceTopKRouter(DIM, E, 2))
    holder.moe.init_weights(0.3)
    return holder.to(device=device, dtype=dtype)


@pytest.mark.parametrize("capacity_factor", [0.0, float(E)], ids=["dropless", "capacity"])
def test_expert_parallel_moe_on_one_device(device, one_rank_mesh, capacity_factor):
    """CUDA branch: expertparallel dispatch / combine (NCCL, permute kernel, grouped_mm in bf16)
    -- a MoE block with expert parallel on a 1-rank group equals the same block without it,
    forward and backward; under set_sync_debug_mode the dropless forward makes exactly its counted
    host sync and capacity mode none."""
    from plait.expertparallel import ExpertParallelConfig, apply_expert_parallel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref, ep = _moe_block(device, dtype), _moe_block(device, dtype)
    config = ExpertParallelConfig(capacity_factor=capacity_factor, rows_equal_by_construction=True)
    dispatcher = apply_expert_parallel(ep, one_rank_mesh, ["moe.experts"], config)["moe.experts"]
    x = torch.randn(2, 16, DIM, device=device, dtype=dtype)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    yr = ref.moe(xr)
    yr.float().square().sum().backward()
    with CudaSyncs(device, "warn") as syncs:
        ye = ep.moe(xe)
        ye.float().square().sum().backward()
    expected = 1 if capacity_factor == 0 else 0
    assert dispatcher.host_syncs == expected
    if device.type == "cuda":
        assert syncs.count == expected, f"{syncs.count} synchronizing CUDA calls, expected {expected}"
    tol = BF16_TOL if dtype == torch.bfloat16 else 1e-5
    _close(ye, yr, tol, "moe out")
    _close(xe.grad, xr.grad, tol, "moe dx")
    w_ep = ep.moe.experts.w1.grad
    _close(w_ep.to_local() if hasattr(w_ep, "to_local") else w_ep, ref.moe.experts.w1.grad, tol, "moe dw1")


@pytest.mark.cuda_only
def test_expert_gradient_reduction_with_a_divide_factor(device, one_rank_mesh):
    """CUDA branch: dataparallel/fsdp.py:_set_divide_factor -- the experts' FSDP gradient
    reduction with a custom divide factor is NCCL PREMUL_SUM on CUDA: on a 1-rank mesh the gradient
    is the local one divided by the factor. (cuda_only: on a 1-rank gloo mesh the SUM-then-divide
    path divides twice, 1/16 for a factor 4, while 2 gloo ranks give the right 2/4; the trainer
    never builds a 1-rank expert FSDP mesh, so the dry run cannot stand in for the NCCL path.)"""
    from plait.dataparallel import DataParallelConfig
    from plait.dataparallel.fsdp import shard_module

    torch.manual_seed(0)
    experts = GroupedExperts(DIM, HIDDEN, E).to(device)
    experts.init_weights(0.3)
    ref = GroupedExperts(DIM, HIDDEN, E).to(device)
    ref.load_state_dict(experts.state_dict())
    counts = torch.tensor([4, 0, 8, 4, 0, 8, 4, 4], device=device)
    x = torch.randn(int(counts.sum()), DIM, device=device)
    shard_module(experts, one_rank_mesh, DataParallelConfig(), True, experts=True, gradient_divide_factor=4.0)
    experts(x, counts).square().sum().backward()
    ref(x, counts).square().sum().backward()
    for name in ("w1", "w2", "w3"):
        got = getattr(experts, name).grad
        got = got.full_tensor() if hasattr(got, "full_tensor") else got
        _close(got, getattr(ref, name).grad / 4.0, 1e-5, f"divided {name}")


def _nccl_rank(rank, world_size, store_path, results):
    """One rank of the 2-GPU test: uneven all-to-all (rank r sends r + 1 + p rows to peer p)."""
    from torch.distributed._functional_collectives import all_to_all_single_autograd

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world_size, device_id=device)
    send = [rank + 1 + p for p in range(world_size)]
    recv = [p + 1 + rank for p in range(world_size)]
    x = torch.cat([torch.full((n, 4), float(10 * rank + p), device=device) for p, n in enumerate(send)])
    x.requires_grad_()
    y = all_to_all_single_autograd(x, recv, send, dist.group.WORLD)
    y.backward(torch.ones_like(y))
    expected = torch.cat([torch.full((n, 4), float(10 * p + rank), device=device) for p, n in enumerate(recv)])
    results.put((rank, torch.equal(y.detach(), expected) and torch.equal(x.grad, torch.ones_like(x))))
    dist.destroy_process_group()


@pytest.mark.cuda_only
def test_nccl_uneven_all_to_all_two_gpus(device, n_gpus):
    """CUDA branch: expertparallel/dispatch.py (NCCL all_to_all_single, uneven splits, 2 ranks) --
    every rank receives exactly its peers' rows, and gradients flow back."""
    if n_gpus < 2:
        pytest.skip(f"needs 2 GPUs for a 2-rank NCCL group, this machine has {n_gpus}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_nccl_rank, args=(r, 2, os.path.join(tmp, "store"), results)) for r in range(2)]
        for p in procs:
            p.start()
        outcome = dict(results.get(timeout=180) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    assert outcome == {0: True, 1: True}
