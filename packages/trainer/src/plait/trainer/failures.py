"""What ends a run and the code it exits with: divergence, out of memory, an infrastructure fault
(requeue-able), a configuration error, a bug (exit_codes.py lists the codes); and the faults the
exit-code tests inject at a given step."""

import os
import signal

import torch
import torch.distributed as dist

from . import exit_codes
from .config import ConfigError


class TrainingDiverged(RuntimeError):
    """The loss or gradient norm became NaN/inf; the message names the step and what to try."""


def exit_code_of(error: BaseException) -> int:
    """The code plait-train exits with for an exception that ends the run (exit_codes.py)."""
    if isinstance(error, TrainingDiverged):
        return exit_codes.DIVERGED
    if isinstance(error, KeyboardInterrupt):
        return exit_codes.INTERRUPTED
    if out_of_memory(error):
        return exit_codes.OUT_OF_MEMORY
    if infrastructure_fault(error):
        return exit_codes.INFRA
    if isinstance(error, ConfigError) or type(error).__name__ == "CheckpointException":
        return exit_codes.CONFIG
    return exit_codes.ERROR


# What a collective raises on the ranks that survive a rank that died (gloo / NCCL), by message.
_LOST_PEER = ("connection closed by peer", "connection reset by peer", "broken pipe", "socket timeout",
              "nccl error", "ncclremoteerror", "timed out", "process group has been destroyed")


# What torch raises when memory runs out where it is not an OutOfMemoryError (the CPU allocator).
_OUT_OF_MEMORY = ("defaultcpuallocator: can't allocate memory", "out of memory", "cannot allocate memory")


def out_of_memory(error: BaseException) -> bool:
    """Device or host memory ran out: the same config runs out again (not requeued)."""
    if isinstance(error, (MemoryError, torch.OutOfMemoryError)):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error).lower() for m in _OUT_OF_MEMORY)


def infrastructure_fault(error: BaseException) -> bool:
    """A fault of the machine rather than of the run: I/O, a lost rank, a collective timeout
    (requeue-able). Not out of memory (out_of_memory), not a collective mismatch (a bug)."""
    if out_of_memory(error):
        return False
    if isinstance(error, exit_codes.InfrastructureFault):
        return True
    if isinstance(error, OSError) and not isinstance(error, (FileNotFoundError, NotADirectoryError,
                                                             IsADirectoryError, PermissionError)):
        return True  # ENOSPC, EIO, EROFS, ...; a missing or forbidden path is a configuration error
    if isinstance(error, (dist.DistError, RuntimeError)):
        text = str(error).lower()
        if "mismatch" in text:  # ranks disagree on a collective: a bug or a config, not the machine
            return False
        return isinstance(error, dist.DistError) or any(m in text for m in _LOST_PEER)
    return False


# PLAIT_TEST_FAULT="<step>:<kind>": raise at that step what the fault raises (tests of the exit
# codes with real processes): oom (torch's CPU allocator), lost_peer (a collective after a peer died),
# kill (SIGKILL, e.g. one rank of a torchrun --max-restarts run).
TEST_FAULT = "PLAIT_TEST_FAULT"


_TEST_FAULTS = {
    "oom": lambda: RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory: "
                                "you tried to allocate 393215999999 bytes."),
    "lost_peer": lambda: RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"),
}


def test_fault(step: int) -> None:
    """`<step>:<kind>[:<rank>[:<restart>]]`: on every rank, or on that rank only, and in that
    torchrun attempt only (TORCHELASTIC_RESTART_COUNT) when given."""
    spec = os.environ.get(TEST_FAULT)
    if spec:
        at, kind, *where = spec.split(":")
        rank, attempt = (where + [None, None])[:2]
        if int(at) != step or (rank is not None and rank != os.environ.get("RANK", "0")):
            return
        if attempt is not None and attempt != os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"):
            return
        if kind == "kill":  # what the OOM killer or a lost node does to one rank
            os.kill(os.getpid(), signal.SIGKILL)
        raise _TEST_FAULTS[kind]()


def check_finite(rows: list[dict]) -> None:
    """Raise TrainingDiverged at the first metrics row whose loss or gradient norm is NaN / inf."""
    for row in rows:
        for key in ("loss", "grad_norm"):
            value = row[key]
            if value != value or value in (float("inf"), float("-inf")):
                raise TrainingDiverged(
                    f"{key} is {value} at step {row['step']}: the run diverged. Try a lower optimizer.lr, "
                    "more lr_scheduler.warmup_steps, a smaller training.max_norm, or training.dtype = float32."
                )
