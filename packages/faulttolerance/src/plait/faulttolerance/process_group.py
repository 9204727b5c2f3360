"""The torchft process group the replicate axis across groups runs on, chosen by device."""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist
from torchft.process_group import ProcessGroup, ProcessGroupBabyNCCL, ProcessGroupGloo, ProcessGroupNCCL

from plait.mesh import device_type


def process_group_kind(requested: str, device: str | None = None) -> str:
    """"auto" -> "nccl" on CUDA when the group itself runs NCCL, else "gloo" (CPU, and CUDA ranks
    that share a GPU over gloo, where NCCL would refuse two ranks on one device)."""
    if requested != "auto":
        return requested
    device = device or device_type()
    group_on_nccl = not dist.is_initialized() or dist.get_backend() == "nccl"
    return "nccl" if device == "cuda" and group_on_nccl else "gloo"


def replicate_process_group(kind: str, timeout: timedelta) -> ProcessGroup:
    """A reconfigurable process group: torchft rebuilds it on every new quorum."""
    if kind == "gloo":
        return ProcessGroupGloo(timeout=timeout)
    if kind == "nccl":
        return ProcessGroupNCCL(timeout=timeout)
    if kind == "baby_nccl":
        return ProcessGroupBabyNCCL(timeout=timeout)
    raise ValueError(f"unknown process group kind {kind!r}")
