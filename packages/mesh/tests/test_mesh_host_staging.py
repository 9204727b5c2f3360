"""Ranks that share a GPU: the backend choice and its refusals, and point-to-point staged through host
memory (forced onto CPU tensors here: the same code path a CUDA tensor over gloo takes)."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

from plait.mesh import ConfigError, comm_problem, init_distributed
from plait.mesh.host_staging import StagedWork, install_host_staging
from plait.testing import run_on_ranks


def test_backend_choice_is_refused_in_one_line_where_it_cannot_start():
    assert comm_problem("auto", 8, gpus=8) is None
    assert comm_problem("nccl", 4, gpus=8) is None
    assert comm_problem("gloo", 8, gpus=1) is None  # ranks share the GPU
    assert comm_problem("auto", 4, gpus=0) is None  # gloo on CPU
    for backend in ("auto", "nccl"):
        message = comm_problem(backend, 4, gpus=1)
        assert "4 local ranks but 1 GPU" in message and "--comm.backend gloo" in message
        assert "\n" not in message
    assert "--comm.backend gloo" in comm_problem("nccl", 1, gpus=0)
    assert "pick one of auto, nccl, gloo" in comm_problem("mpi", 1, gpus=0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="refusal of nccl on a machine without CUDA")
def test_nccl_without_cuda_is_refused_before_any_collective(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with pytest.raises(ConfigError, match="comm.backend = nccl needs CUDA GPUs"):
        init_distributed(backend="nccl")
    assert not dist.is_initialized()


def _pipeline_grads(rank: int, world_size: int) -> dict:
    """Two pipeline stages of one Linear each (GPipe, 4 micro-batches): the gradients."""
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    torch.manual_seed(0)
    layers = [nn.Linear(16, 16) for _ in range(world_size)]
    stage = PipelineStage(layers[rank], rank, world_size, torch.device("cpu"))
    schedule = ScheduleGPipe(stage, n_microbatches=4, loss_fn=lambda out, target: ((out - target) ** 2).mean())
    x, target = torch.randn(8, 16), torch.randn(8, 16)
    if rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=target)
    return {name: p.grad.clone() for name, p in layers[rank].named_parameters()}


def _staged_point_to_point(rank: int, world_size: int) -> dict:
    native = _pipeline_grads(rank, world_size)
    install_host_staging(stage_cpu=True)
    peer = 1 - rank
    out = {"pipeline_native": native, "pipeline_staged": _pipeline_grads(rank, world_size)}
    # isend / irecv, several in flight between the same pair: matched in the order issued
    sends = [dist.isend(torch.full((3,), float(10 * rank + i)), peer) for i in range(3)]
    received = [torch.empty(3) for _ in range(3)]
    recvs = [dist.irecv(t, peer) for t in received]
    out["kinds"] = sorted({type(w).__name__ for w in sends + recvs})
    for work in sends + recvs:
        work.wait()
    out["isend"] = [t.tolist() for t in received]
    # waiting on the last work completes the ones issued before it (a schedule that waits on one)
    received = [torch.empty(2) for _ in range(3)]
    works = [dist.isend(torch.full((2,), float(rank + i)), peer) for i in range(3)]
    works += [dist.irecv(t, peer) for t in received]
    works[-1].wait()
    out["last_only"] = [t.tolist() for t in received] + [all(w.is_completed() for w in works)]
    # blocking send / recv, and recv's return value (the sender's rank)
    t = torch.arange(4.0) + rank
    if rank == 0:
        dist.send(t, 1)
        out["recv_from"] = None
    else:
        out["recv_from"] = dist.recv(t, 0)
    out["recv"] = t.tolist()
    # batch_isend_irecv (what ring attention and the pipeline schedules call)
    got = torch.empty(2, 5)
    works = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, torch.full((2, 5), float(rank)), peer), dist.P2POp(dist.irecv, got, peer)]
    )
    for work in works:
        work.wait()
    out["batch"] = got.unique().tolist()
    out["batch_kinds"] = sorted({type(w).__name__ for w in works})
    return out


def test_staged_point_to_point_matches_gloos_own():
    results = run_on_ranks(_staged_point_to_point, 2, timeout=120)
    for rank, out in enumerate(results):
        peer = 1 - rank
        assert out["kinds"] == [StagedWork.__name__] and out["batch_kinds"] == [StagedWork.__name__]
        assert out["isend"] == [[float(10 * peer + i)] * 3 for i in range(3)]
        assert out["batch"] == [float(peer)]
        assert out["last_only"] == [[float(peer + i)] * 2 for i in range(3)] + [True]
        for name, grad in out["pipeline_native"].items():
            assert torch.equal(grad, out["pipeline_staged"][name]), name
    assert results[1]["recv_from"] == 0 and results[1]["recv"] == [0.0, 1.0, 2.0, 3.0]
