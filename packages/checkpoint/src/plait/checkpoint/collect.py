"""The collectives of a distributed checkpoint (each a no-op without a process group) and the
tests' hooks that kill every rank at an exact point of a save."""

import os
import signal

import torch.distributed as dist

# Test hooks (the checkpoint tests' only way to die at an exact point): SIGKILL every rank right
# after the checkpoint of step N is published, or after its files are written but before the marker.
KILL_AFTER_SAVE = "PLAIT_TEST_KILL_AFTER_SAVE"
KILL_DURING_SAVE = "PLAIT_TEST_KILL_DURING_SAVE"
# Test hook: every synchronous full save first sleeps this many seconds (a large model's save),
# to show that the launcher's grace on SIGTERM (job.stop_grace_s) must cover the final save.
SLOW_SAVE = "PLAIT_TEST_SLOW_SAVE_S"


def test_kill(variable: str, step: int) -> None:
    if os.environ.get(variable) == str(step):
        os.kill(os.getpid(), signal.SIGKILL)


def broadcast(obj):
    """Rank 0's `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
