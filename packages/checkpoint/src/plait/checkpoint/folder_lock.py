"""A lock on a folder: `<folder>/<name>`, created with O_EXCL, that one live process holds.

Two runs writing one checkpoint folder would delete each other's saves in progress and overwrite
each other's checkpoints. The lock file (atomic O_EXCL create on local and NFS v3+ filesystems)
holds the owner's pid, host and process start time. A lock whose owner is gone (same host, pid
dead or reused by another process) is stale: it is taken over with a warning. A lock held from
another host cannot be checked from here: the error says so. Deciding that a lock is stale and
replacing it happen under an flock on a guard file next to it (`<lock>.guard`, never deleted; the
kernel releases an flock when its process dies), so of many processes that find the same stale
lock at once exactly one takes it.
"""

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from plait.mesh.errors import ConfigError

# A checkpoint folder's lock: CheckpointWriter takes it (rank 0), plait-train for its checkpoint.folder.
CHECKPOINT_LOCK_NAME = ".plait-checkpoint.lock"


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


class FolderLock:
    """The lock of one folder; `acquire` raises ConfigError (one line) if another live process holds it."""

    def __init__(self, folder: str, name: str, setting: str, note: dict | None = None):
        self.path = Path(folder) / name
        self.setting = setting  # the setting the error names
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
            self._acquired()
            return warning
        raise ConfigError(f"{self.setting}: could not take the lock {self.path}; another run is starting there.")

    def _acquired(self) -> None:
        """Called under the guard right after the lock is taken (a subclass records its state)."""

    def release(self) -> None:
        """Remove the lock file if this process still owns it."""
        self.held = False
        try:
            if json.loads(self.path.read_text()).get("pid") == self.owner["pid"]:
                self.path.unlink()
        except (OSError, ValueError):
            pass

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

    def free(self) -> bool:
        """No live run holds this lock (none, or a stale one)."""
        if not self.path.exists():
            return True
        holder = self._read()
        return holder is not None and self._stale(holder)
