"""Ranks that share one GPU (comm.backend gloo, issue 50): the CUDA-only branches.

- plait.mesh.init_distributed("gloo") on CUDA: local rank r on cuda:(r % GPUs), point-to-point of
  CUDA tensors staged through pinned host memory (host_staging.py), values and streams right;
- plait.testing.run_on_ranks(device="cuda");
- FSDP on CUDA over gloo reduces with SUM and lets FSDP divide (dataparallel.fsdp.reduce_on_gloo):
  the gradients of two ranks equal one process's over the whole batch;
- the trainer's memory check gives each rank its share of a shared GPU.

The parity matrix's CUDA subset (every layout, both models, fp32 and bf16) is gpu/parity.py's.
"""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.testing import run_on_ranks

cuda_only = pytest.mark.cuda_only


def _share_the_gpu(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from plait.dataparallel import DataParallelConfig
    from plait.dataparallel.fsdp import shard_module
    from plait.mesh import init_distributed
    from plait.mesh.host_staging import host_staging_installed

    info = init_distributed("gloo")  # the harness's group is kept; LOCAL_WORLD_SIZE = 2 > 1 GPU is fine
    out = {"device": str(info.device), "current": torch.cuda.current_device(), "backend": info.backend,
           "staging": host_staging_installed()}  # fmt: skip
    peer = 1 - rank
    # staged point-to-point of CUDA tensors, the value computed on the stream just before the send
    side = torch.randn(1 << 20, device="cuda")
    sent = (side * 0 + rank + 1).sum().reshape(1).repeat(4)
    got = torch.zeros(4, device="cuda")
    works = dist.batch_isend_irecv([dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)])
    for work in works:
        work.wait()
    out["p2p"] = got.cpu().tolist()
    # FSDP over gloo on CUDA: two ranks' gradients against one process over both ranks' rows
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()
    reference = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32)).cuda()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1)).cuda()
    mesh = init_device_mesh("cuda", (world_size,))
    shard_module(model, mesh, DataParallelConfig(), reshard_after_forward=True)
    model(x[rank]).pow(2).mean().backward()
    reference(x.flatten(0, 1)).pow(2).mean().backward()
    out["grad_diff"] = max(
        (p.grad.full_tensor() - r.grad).abs().max().item() for p, r in zip(model.parameters(), reference.parameters())
    )
    return out


@cuda_only
def test_two_ranks_share_the_gpu_over_gloo():
    results = run_on_ranks(_share_the_gpu, 2, device="cuda", timeout=180)
    gpus = torch.cuda.device_count()
    for rank, out in enumerate(results):
        assert out["device"] == f"cuda:{rank % gpus}" and out["current"] == rank % gpus
        assert out["backend"] == "gloo" and out["staging"]
        assert out["p2p"] == [float((1 - rank) + 1) * (1 << 20)] * 4
        assert out["grad_diff"] < 1e-5, out["grad_diff"]


@cuda_only
def test_a_shared_gpu_is_divided_between_its_ranks(monkeypatch):
    from plait.trainer.memory_estimate import device_memory

    total = torch.cuda.get_device_properties(0).total_memory
    monkeypatch.setenv("LOCAL_RANK", "0")
    gpus = torch.cuda.device_count()
    assert device_memory(gpus)[0] == total
    share, where = device_memory(4 * gpus)
    assert share == total // 4 and "4 ranks on it" in where


@cuda_only
def test_auto_refuses_more_ranks_than_gpus():
    from plait.mesh import comm_problem

    gpus = torch.cuda.device_count()
    assert comm_problem("auto", gpus) is None
    assert "--comm.backend gloo" in comm_problem("auto", gpus + 1)
    assert comm_problem("gloo", gpus + 1) is None
