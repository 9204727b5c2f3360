"""Process-group start-up: backend, device and threads per rank.

`backend` (`--comm.backend` in plait-train):

- `auto`: nccl where every local rank has a GPU of its own, gloo on a machine without CUDA;
- `nccl`: as auto, but refused without CUDA;
- `gloo`: gloo everywhere. On a CUDA machine local rank r computes on `cuda:(r % GPUs)`, so several
  ranks may share one GPU (NCCL refuses that: "Duplicate GPU detected"); the collectives run on
  CUDA tensors through gloo, which stages them through host memory. Slow, but every CUDA code path
  and its numerics are real. What gloo lacks for CUDA tensors is staged here (host_staging.py).

Where local ranks outnumber the GPUs under auto or nccl the run is refused before any collective
(`comm_problem`), in one line naming `--comm.backend gloo`.
"""

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .errors import ConfigError
from .host_staging import install_host_staging

BACKENDS = ("auto", "nccl", "gloo")


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


def comm_problem(backend: str | None, local_world_size: int, gpus: int | None = None) -> str | None:
    """Why `backend` cannot start `local_world_size` ranks on this node (one line), or None.
    `gpus`: the node's CUDA devices (default: counted here)."""
    backend = backend or "auto"
    if backend not in BACKENDS:
        return f"comm.backend = {backend!r}: pick one of {', '.join(BACKENDS)}."
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if backend == "nccl" and gpus == 0:
        return "comm.backend = nccl needs CUDA GPUs and this machine has none: use --comm.backend gloo (or auto)."
    if backend in ("auto", "nccl") and 0 < gpus < local_world_size:
        return (f"comm.backend = {backend}: {local_world_size} local ranks but {gpus} GPU(s), and NCCL refuses two "
                f"ranks on one GPU; use --comm.backend gloo (ranks share the GPUs, collectives through host "
                f"memory) or start at most {gpus} rank(s) per node.")  # fmt: skip
    return None


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def init_distributed(
    backend: str | None = "auto",
    timeout_s: float = 600.0,
    cpu_threads: int | None = None,
) -> DistributedInfo:
    """Start the process group from torchrun's environment (or a single process without one).

    See the module docstring for `backend`. On CPU the cores are split between the local ranks,
    since each rank's intra-op pool would otherwise take them all and the ranks would thrash. A
    process group that already exists (a test harness's) is kept; its backend is reported.
    """
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_rank, local_world_size = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    problem = comm_problem(backend, local_world_size)
    if problem:
        raise ConfigError(problem)
    gpus = torch.cuda.device_count()
    if gpus:
        device = torch.device("cuda", local_rank % gpus)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        torch.set_num_threads(cpu_threads or max(1, cores // local_world_size))
    chosen = None
    if world_size > 1:
        if dist.is_initialized():
            chosen = dist.get_backend()
        else:
            chosen = "gloo" if backend == "gloo" or not gpus else "nccl"
            dist.init_process_group(
                backend=chosen,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=device if chosen == "nccl" else None,
            )
        if chosen == "gloo" and device.type == "cuda":
            install_host_staging()
    return DistributedInfo(rank, local_rank, world_size, local_world_size, device, chosen)


def collectives_on_gloo(mesh) -> bool:
    """Whether `mesh`'s collectives run on gloo: every CPU mesh (plait-plan's fake groups stand
    for gloo there), and CUDA meshes whose ranks share GPUs (comm.backend gloo)."""
    if mesh.device_type == "cpu":
        return True
    return dist.get_backend(mesh.get_group(0)) == "gloo"


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
