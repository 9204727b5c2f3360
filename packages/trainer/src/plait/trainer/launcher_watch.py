"""Ranks die with their launcher: a rank whose `plait-train` / torchrun was SIGKILLed must not keep
training and writing checkpoints with no supervisor.

Linux: prctl(PR_SET_PDEATHSIG, SIGKILL) has the kernel kill the rank when its parent exits. As a
fallback (other systems, or a parent thread that exits) a daemon thread polls os.getppid(): a
changed parent means the launcher is gone (the rank was re-parented to init or a subreaper).
"""

import ctypes
import ctypes.util
import os
import signal
import sys
import threading

PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15
POLL_S = 1.0


def _prctl(option: int, value) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def set_parent_death_signal() -> bool:
    """The kernel SIGKILLs this process when its parent exits (Linux; False elsewhere)."""
    return _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def name_process(name: str) -> None:
    """The process's name in ps, top and /proc/PID/comm (15 characters): `plait-rank<N>` is how a
    rank is found from outside (a forked rank's /proc environ and cmdline are the launcher's)."""
    _prctl(PR_SET_NAME, ctypes.c_char_p(name[:15].encode()))


def _watch(parent: int) -> None:
    event = threading.Event()
    while not event.wait(POLL_S):
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)


def die_with_launcher() -> None:
    """Call first thing in a rank started by a launcher."""
    parent = os.getppid()
    # (No "parent is 1 means orphaned" shortcut: a launcher may itself be pid 1 in a container.)
    set_parent_death_signal()
    threading.Thread(target=_watch, args=(parent,), name="plait-launcher-watch", daemon=True).start()
