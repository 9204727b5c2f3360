"""Process-group start-up: backend, device and threads per rank."""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistributedInfo:
    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    device: torch.device
    backend: str | None  # None when the run is a single process without a process group


def device_type() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def init_distributed(
    backend: str | None = None,
    timeout_s: float = 600.0,
    cpu_threads: int | None = None,
) -> DistributedInfo:
    """Start the process group from torchrun's environment (or a single process without one).

    nccl on CUDA, gloo on CPU; `backend="gloo"` forces gloo even where CUDA is present. On CPU the
    cores are split between the local ranks, since each rank's intra-op pool would otherwise take
    them all and the ranks would thrash.
    """
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() and backend != "gloo"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(cpu_threads or max(1, cores // local_world_size))
    chosen = None
    if world_size > 1:
        chosen = backend or ("nccl" if use_cuda else "gloo")
        if not dist.is_initialized():
            dist.init_process_group(
                backend=chosen,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if use_cuda else None,
            )
    return DistributedInfo(rank, local_rank, world_size, local_world_size, device, chosen)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
