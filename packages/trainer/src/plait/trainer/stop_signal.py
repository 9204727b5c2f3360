"""SIGTERM as a request to stop after the current step, agreed on by every rank."""

import signal

import torch
import torch.distributed as dist


class StopSignal:
    """SIGTERM sets a flag; the loop finishes its step, writes its metrics, saves (with checkpoints
    enabled) and the run ends unfinished (plait-train exits 75 so schedulers requeue it)."""

    def __init__(self):
        self.requested = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame):
        self.requested = True

    def agreed(self, device: torch.device) -> bool:
        """Whether any rank was asked to stop (a collective: call on every rank at the same step)."""
        if not dist.is_initialized():
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def restore(self):
        signal.signal(signal.SIGTERM, self._previous)
