"""One run per dump folder: an exclusive lock file `<job.dump_folder>/.plait-run.lock`.

Two runs in one folder would delete each other's saves in progress, overwrite each other's
checkpoints and tear lines of metrics.jsonl. The lock is a file created with O_EXCL (atomic on
local and NFS v3+ filesystems) holding the owner's pid, host and process start time. A lock whose
owner is gone (same host, pid dead or reused by another process) is stale: it is taken over with
a warning. A lock held from another host cannot be checked from here: the error says so.
Deciding that a lock is stale and replacing it happen under an flock on a guard file next to it
(`<lock>.guard`, never deleted; the kernel releases an flock when its process dies), so of many
runs that find the same stale lock at once exactly one takes it.

The checkpoint folder has its own lock (`<checkpoint.folder>/.plait-checkpoint.lock`, taken by
rank 0): two runs with different dump folders and the same checkpoint.folder would otherwise
delete each other's saves in progress.

Who takes it: `plait-train --nproc-per-node N` takes it before starting any rank and tells the
ranks through PLAIT_RUN_LOCK; under torchrun (or one process) rank 0 takes it before any
collective and the verdict is broadcast, so every rank fails the same way and none waits.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from . import exit_codes
from .config import ConfigError

LOCK_NAME = ".plait-run.lock"
CHECKPOINT_LOCK_NAME = ".plait-checkpoint.lock"
# Set by the plait launcher for its ranks: the lock file it holds for them.
HELD_BY_LAUNCHER = "PLAIT_RUN_LOCK"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, another user's
    now = _start_time(pid)
    if now is None:
        return True
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z" and (start is None or now == start)


class RunLock:
    """The lock of one dump folder; `acquire` raises ConfigError (one line) if another run holds it."""

    def __init__(self, dump_folder: str, name: str = LOCK_NAME, setting: str = "job.dump_folder",
                 status: bool = True, note: dict | None = None):
        self.path = Path(dump_folder) / name
        self.setting = setting  # the setting the error names
        self.status = status  # this lock's holder writes exit_status next to it
        self.owner = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid()),
                      **(note or {})}
        self.held = False

    @contextlib.contextmanager
    def _guard(self):
        """Serialise every acquirer of this lock (an flock: released by the kernel if we die)."""
        fd = os.open(self.path.with_name(self.path.name + ".guard"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the flock

    def acquire(self) -> str | None:
        """Take the lock; return a warning when a stale lock was taken over, else None."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._guard():
                return self._acquire()
        except OSError as e:  # a path under a file, a read-only or full disk: one line, not a traceback
            raise ConfigError(f"{self.setting} = {str(self.path.parent)!r} cannot be used: {e.strerror}") from None

    def _acquire(self) -> str | None:
        warning = None
        for _ in range(3):  # a lock file released (or being written) meanwhile: look again
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._read()
                if holder is None:
                    time.sleep(0.1)  # being written right now
                    holder = self._read()
                if holder is not None and not self._stale(holder):
                    dump = f", dump folder {holder['dump_folder']}" if holder.get("dump_folder") else ""
                    raise ConfigError(
                        f"{self.setting} = {str(self.path.parent)!r} is in use by another run (pid "
                        f"{holder.get('pid')} on {holder.get('host')}{dump}, since {holder.get('since', '?')}): wait "
                        f"for it or stop it, or use another {self.setting} (if that run is gone, delete {self.path})."
                    ) from None
                warning = f"took over the stale lock {self.path} of a run that is gone ({holder})"
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                json.dump(dict(self.owner, since=time.strftime("%Y-%m-%dT%H:%M:%S")), f)
            self.held = True
            self.acquired_at = time.time()
            if self.status:
                self._write_status(exit_codes.RUNNING)  # stays if this run is SIGKILLed
            return warning
        raise ConfigError(f"{self.setting}: could not take the lock {self.path}; another run is starting there.")

    def _read(self) -> dict | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) else {}
        except FileNotFoundError:
            return {"pid": None}  # released meanwhile: stale
        except (OSError, ValueError):
            return None

    def _stale(self, holder: dict) -> bool:
        pid = holder.get("pid")
        if not isinstance(pid, int):
            return True  # empty or damaged file: a run killed while writing it
        if holder.get("host") != self.owner["host"]:
            return False  # cannot look at another host's processes
        if pid == os.getpid():
            return True  # our own pid, reused (a requeued container starts at the same pids)
        return not _alive(pid, holder.get("start"))

    def _write_status(self, status: str) -> None:
        tmp = self.path.parent / f".{exit_codes.STATUS_FILE}.tmp"
        tmp.write_text(f"{status}\n")
        os.replace(tmp, self.path.parent / exit_codes.STATUS_FILE)

    def free(self) -> bool:
        """No live run holds this lock (none, or a stale one)."""
        if not self.path.exists():
            return True
        holder = self._read()
        return holder is not None and self._stale(holder)

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
        self.held = False
        try:
            if self.status:
                exit_code, self.why = exit_codes.settle(exit_code, self.path.parent, self.acquired_at)
                self._write_status(str(exit_code))
        except OSError:
            pass
        try:
            if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass
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
