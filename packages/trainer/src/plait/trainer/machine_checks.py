"""What this machine can run: the collective backend for its GPUs, and the estimated peak memory
for its device (checked where the run starts, not for a layout planned for another machine)."""

import os

import torch
from torch import nn

from plait.mesh import ParallelDims, comm_problem, elastic_problem

from .config import Config, ConfigError


def check_comm(config: Config, world_size: int) -> None:
    """The backend can start this node's ranks (nccl refuses two ranks on one GPU), and torchrun's
    restarts, if asked for, would not hang (plait.mesh.elastic_problem)."""
    if world_size == 1 and config.comm.backend != "nccl":
        return
    problem = comm_problem(config.comm.backend, int(os.environ.get("LOCAL_WORLD_SIZE") or world_size))
    problem = problem or elastic_problem()
    if problem:
        raise ConfigError(problem)


def check_memory_fits(config: Config, dims: ParallelDims, model: nn.Module, info: dict, world_size: int) -> None:
    """The estimated per-rank peak fits the device (a one-line refusal, not an allocator traceback)."""
    if not config.training.memory_check or config.checkpoint.create_seed_checkpoint:
        return  # a seed checkpoint neither trains nor builds optimizer state
    if torch.cuda.is_available() and "LOCAL_RANK" not in os.environ and world_size > 1:
        return  # the launcher: each rank checks its own GPU; the launcher must not touch CUDA
    from .memory_estimate import memory_problem

    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or world_size)
    problem = memory_problem(config, dims, model, info, local_ranks)
    if problem:
        raise ConfigError(problem)
