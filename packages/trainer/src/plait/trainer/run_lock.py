"""One run per dump folder: an exclusive lock file `<job.dump_folder>/.plait-run.lock`.

Two runs in one folder would delete each other's saves in progress, overwrite each other's
checkpoints and tear lines of metrics.jsonl. The lock itself (stale
owners, the guard, one-line errors) is plait-checkpoint's `FolderLock`; what the run adds is the
exit status its holder records next to it (exit_codes.py).

The checkpoint folder has its own lock (`<checkpoint.folder>/.plait-checkpoint.lock`, taken by
rank 0): two runs with different dump folders and the same checkpoint.folder would otherwise
delete each other's saves in progress.

Who takes it: `plait-train --nproc-per-node N` takes it before starting any rank and tells the
ranks through PLAIT_RUN_LOCK; under torchrun (or one process) rank 0 takes it before any
collective and the verdict is broadcast, so every rank fails the same way and none waits.
"""

import os
from pathlib import Path

import torch.distributed as dist

from plait.checkpoint.folder_lock import CHECKPOINT_LOCK_NAME, FolderLock

from . import exit_codes
from .config import Config, ConfigError
from .log import log

LOCK_NAME = ".plait-run.lock"  # CHECKPOINT_LOCK_NAME (plait-checkpoint's): the checkpoint folder's
# Set by the plait launcher for its ranks: the lock file it holds for them.
HELD_BY_LAUNCHER = "PLAIT_RUN_LOCK"


class RunLock(FolderLock):
    """The lock of one dump folder; its holder writes the run's exit_status next to it."""

    def __init__(self, dump_folder: str, name: str = LOCK_NAME, setting: str = "job.dump_folder",
                 status: bool = True, note: dict | None = None):
        super().__init__(dump_folder, name, setting, note)
        self.status = status  # this lock's holder writes exit_status next to it

    def _acquired(self) -> None:
        if self.status:
            self._write_status(exit_codes.RUNNING)  # stays if this run is SIGKILLed

    def _write_status(self, status: str) -> None:
        tmp = self.path.parent / f".{exit_codes.STATUS_FILE}.tmp"
        tmp.write_text(f"{status}\n")
        os.replace(tmp, self.path.parent / exit_codes.STATUS_FILE)

    def write_status_if_free(self, exit_code: int) -> None:
        """A run that failed before taking the lock (its configuration): record its code in
        exit_status too, so a requeued job does not read the previous run's (a stale 75 would be
        requeued forever), unless another live run holds the folder (then the file is its)."""
        try:
            if self.status and self.path.parent.is_dir() and self.free():
                self._write_status(str(exit_code))
        except OSError:
            pass

    def release(self, exit_code: int) -> int:
        """Settle the run's exit code (exit_codes.settle: a requeue-able failure at the same step as
        the previous run's is not requeued again), record it in <dump_folder>/exit_status, remove
        the lock if this process still owns it; return the settled code (`self.why`: what changed it)."""
        self.why = ""
        if not self.held:
            return exit_code
        try:
            if self.status:
                exit_code, self.why = exit_codes.settle(exit_code, self.path.parent, self.acquired_at)
                self._write_status(str(exit_code))
        except OSError:
            pass
        super().release()
        return exit_code


class RunLocks:
    """The locks one run holds (dump folder, checkpoint folder), released together."""

    def __init__(self):
        self.locks: list[RunLock] = []
        self.warnings: list[str] = []

    def take(self, lock: RunLock) -> None:
        warning = lock.acquire()  # raises ConfigError if another run holds it: not ours to release
        self.locks.append(lock)
        if warning:
            self.warnings.append(warning)

    def release(self, exit_code: int) -> tuple[int, str]:
        """Release every lock; (the settled exit code, why it changed) from the dump folder's."""
        settled, why = exit_code, ""
        for lock in reversed(self.locks):
            code = lock.release(exit_code)
            if lock.status:
                settled, why = code, lock.why
        return settled, why


def take_run_locks(config: Config, rank: int) -> RunLocks | None:
    """Rank 0 locks the dump folder (unless the plait launcher holds it for the ranks) and the
    checkpoint folder, and every rank learns the verdict, so all fail with the same line and none
    waits in a collective."""
    locks, verdict = None, None
    if rank == 0:
        locks = RunLocks()
        try:
            if not os.environ.get(HELD_BY_LAUNCHER):
                locks.take(RunLock(config.job.dump_folder))
            c = config.checkpoint
            folder = Path(config.job.dump_folder) / c.folder
            if (c.enable or c.create_seed_checkpoint) and folder.resolve() != Path(config.job.dump_folder).resolve():
                locks.take(RunLock(str(folder), CHECKPOINT_LOCK_NAME, "checkpoint.folder", status=False,
                                   note={"dump_folder": os.path.abspath(config.job.dump_folder)}))
            verdict = ("ok", locks.warnings)
        except ConfigError as e:
            locks.release(exit_codes.CONFIG)
            verdict = ("error", str(e))
    if dist.is_initialized():
        box = [verdict]
        dist.broadcast_object_list(box, src=0)
        verdict = box[0]
    kind, value = verdict
    if kind == "error":
        raise ConfigError(value)
    for warning in value if rank == 0 else []:
        log.warning(warning)
    return locks
