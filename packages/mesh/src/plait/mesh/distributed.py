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

Under torchrun --max-restarts the ranks meet in a store keyed by run and restart (`_elastic_store`),
so a restarted rank never reads the previous attempt's addresses; over several launchers a restart
needs TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (`elastic_problem` says so).
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
    problem = comm_problem(backend, local_world_size) or elastic_problem()
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
            timeout = datetime.timedelta(seconds=timeout_s)
            dist.init_process_group(
                backend=chosen,
                timeout=timeout,
                device_id=device if chosen == "nccl" else None,
                **_elastic_store(rank, world_size, timeout),
            )
        if chosen == "gloo" and device.type == "cuda":
            install_host_staging()
    return DistributedInfo(rank, local_rank, world_size, local_world_size, device, chosen)


def elastic_problem(env: dict | None = None) -> str | None:
    """Why torchrun's restarts of this job would hang (one line), or None. With its rendezvous store
    shared with the ranks (the default) and several launchers (--nnodes), a launcher whose ranks
    did not fail restarts them without counting a restart, so the launchers' ranks key the store
    by different attempt numbers and wait for each other forever (pytorch#135712)."""
    env = os.environ if env is None else env
    shared = env.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    restarts = int(env.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    launchers = int(env.get("WORLD_SIZE") or 1) > int(env.get("LOCAL_WORLD_SIZE") or 1)
    if shared and restarts > 0 and launchers:
        return (f"torchrun --max-restarts {restarts} over several launchers (--nnodes) shares its rendezvous store "
                "with the ranks, and a restart would hang the launchers whose ranks did not fail: set "
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment on every node (or --max-restarts 0 "
                "and let the scheduler requeue).")  # fmt: skip
    return None


def _elastic_store(rank: int, world_size: int, timeout: datetime.timedelta) -> dict:
    """Under torchrun's shared rendezvous store (TORCHELASTIC_USE_AGENT_STORE, the default), the
    store the ranks meet in, keyed by run and restart: torch's own env:// path let a restarted
    rank's extra gloo groups (plait's data exchange, the checkpoint writer's) read the previous
    attempt's addresses ("Gloo connectFullMesh ... Connection refused", pytorch#135712), so a
    `--max-restarts` restart failed or hung. Elsewhere torch's defaults (env://)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    agent = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size, False,
                          timeout=timeout)  # fmt: skip
    key = f"/plait/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', 0)}"
    return {"store": dist.PrefixStore(key, agent), "rank": rank, "world_size": world_size}


def collectives_on_gloo(mesh) -> bool:
    """Whether `mesh`'s collectives run on gloo: every CPU mesh (plait-plan's fake groups stand
    for gloo there), and CUDA meshes whose ranks share GPUs (comm.backend gloo)."""
    if mesh.device_type == "cpu":
        return True
    return dist.get_backend(mesh.get_group(0)) == "gloo"


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
