"""Forked ranks for `plait-train --nproc-per-node N`: every rank starts with torch and the trainer
already imported.

A spawned rank spends seconds of CPU importing torch, DTensor, dynamo, datasets and the trainer
before its first line runs (measured on the 2-core CI box, torch 2.13: ~6 s with cached bytecode,
~15 s without), and N ranks do it at once on the node's cores. The launcher instead forks one factory process, which makes those imports once; torch's
elastic agent starts rank_client.py (stdlib only, milliseconds) for each rank, and the client asks
the factory to fork the rank. The rank is then a fresh `python -m plait.trainer` in all that a run
can see: the client's environment, working directory, stdin / stdout / stderr, a session of its
own, default signal handlers, its own atexit handlers and interpreter exit, and its exit code or
signal, which the client passes on to the agent.

Forking is chosen (job.rank_start = auto) where torch has no CUDA build: a process forked after
CUDA's driver was initialised cannot use CUDA, and the launcher's validation may touch it. On a
CUDA build auto spawns, as torch's launcher does, until a GPU lease measures fork there.

Lifetimes: the factory dies with the launcher (parent-death signal), which kills it once the agent
is done; a rank dies with the factory, and the factory kills a rank whose client is gone (the
agent's SIGKILL after the shutdown timeout reaches only the client).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import threading
from pathlib import Path
from typing import NoReturn

from .exit_codes import exit_without_teardown
from .launcher_watch import name_process, set_parent_death_signal

# What the factory imports once, so that no rank does (a package this install lacks is skipped).
PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "datasets", "plait.trainer.cli",
           "plait.trainer.train", "plait.trainer.validate")
CLIENT = Path(__file__).with_name("rank_client.py")


def fork_problem() -> str | None:
    """Why this launcher cannot fork its ranks (None: it can)."""
    import torch

    if not sys.platform.startswith("linux"):
        return f"ranks are forked on Linux only ({sys.platform})"
    if torch.version.cuda is not None or torch.cuda.is_initialized():
        return "a CUDA build of torch (a forked process cannot use a CUDA driver its parent initialised)"
    if threading.active_count() > 1:
        return "the launcher runs Python threads (a fork would not carry them)"
    return None


def client_command() -> list[str]:
    """What torch's agent runs for each rank (with `--no-python`), before the trainer's arguments."""
    return [sys.executable, "-I", "-S", str(CLIENT)]


class RankFactory:
    """The factory process and its socket; `env()` is what the agent's clients need to find it."""

    def __init__(self):
        self.folder = tempfile.mkdtemp(prefix="plait-ranks-")
        self.path = os.path.join(self.folder, "factory")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(self.path)
        listener.listen(256)
        sys.stdout.flush()  # a forked child would write this process's buffered lines again
        sys.stderr.flush()
        launcher = os.getpid()
        self.pid = os.fork()
        if self.pid == 0:
            code = 1
            try:
                _serve(listener, launcher)
                code = 0
            finally:
                os._exit(code)
        listener.close()

    def env(self) -> dict[str, str]:
        return {"PLAIT_RANK_FACTORY": self.path}

    def close(self) -> None:
        """End the factory once the agent is done with the ranks (or never started them). A rank it
        still runs is one whose client the agent killed: it dies with the factory."""
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        shutil.rmtree(self.folder, ignore_errors=True)


def _die_with_parent(parent: int) -> None:
    set_parent_death_signal()
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


def _serve(listener: socket.socket, launcher: int) -> None:
    """The factory: import PRELOAD, then fork a rank for each client and tell the client how it ended."""
    import importlib

    _die_with_parent(launcher)
    # Ctrl-C and the scheduler's SIGTERM reach the launcher's process group: the launcher's agent
    # decides what its ranks get (through their clients), the factory only stops when told.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)
    # The launcher's files (its run lock, its log) stay the launcher's: a rank opens its own.
    keep = {listener.fileno(), 0, 1, 2}
    for fd in map(int, os.listdir("/proc/self/fd")):
        if fd not in keep:
            try:
                os.close(fd)
            except OSError:
                pass
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import gc

    # Every rank shares these pages: frozen, no rank's collection scans (or writes to) them.
    gc.freeze()
    ranks: dict[int, socket.socket] = {}  # pid -> its client's connection
    waiting: dict[socket.socket, int] = {}  # connections whose client may still hang up: pid
    while True:  # until the launcher kills it (close(), or the launcher's own death)
        readable = select.select([listener, *waiting], [], [], 0.05)[0]
        if listener in readable:
            conn, _ = listener.accept()
            try:
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
            except (OSError, ValueError):  # a client killed while it asked: the others' ranks go on
                conn.close()
                continue
            pid = os.fork()
            if pid == 0:
                _become_rank(request, fds)
            for fd in fds:
                os.close(fd)
            ranks[pid], waiting[conn] = conn, pid
            try:
                conn.send(str(pid).encode())
            except OSError:
                pass  # the client is gone: the hang-up below kills the rank
        for conn in readable:
            if conn in waiting and not conn.recv(1):  # the client is gone (killed): so is its rank
                _kill(waiting.pop(conn))
        _reap(ranks, waiting)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _reap(ranks: dict[int, socket.socket], waiting: dict[socket.socket, int]) -> None:
    while ranks:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = ranks.pop(pid, None)
        if conn is None:
            continue
        if waiting.pop(conn, None) is not None:
            try:
                conn.send(str(status).encode())
            except OSError:
                pass  # the client died at the same moment
        conn.close()


def _become_rank(request: dict, fds: list[int]) -> None:
    """In the forked child: become `python -m plait.trainer ARGV` and exit as its interpreter would."""
    import atexit
    import traceback

    try:
        factory = os.getppid()
        os.setsid()  # as torch's agent starts a rank: Ctrl-C at a terminal reaches the launcher only
        _die_with_parent(factory)
        # (SIGPIPE stays ignored, as Python starts it: a closed pipe is an error, not a death.)
        for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCHLD):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in map(int, os.listdir("/proc/self/fd")):  # the factory's socket and connections
            if fd > 2 and fd not in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        name_process(f"plait-rank{os.environ.get('RANK', '')}")
        sys.stdout.reconfigure(write_through=True)  # as `python -u`, which the agent runs ranks with
        sys.stderr.reconfigure(write_through=True)
        atexit._clear()  # the launcher's
    except BaseException:
        traceback.print_exc()
        exit_without_teardown(1)
    run_as_main(["-m", "plait.trainer", *request["argv"]], request["cwd"])


def run_as_main(argv: list[str], cwd: str | Path) -> NoReturn:
    """Run `python *argv` in this (forked) process and exit as its interpreter would (its exit
    code; threads joined, atexit handlers run; no C++ teardown). argv: ["-m", module, args...] or
    [script, args...] (relative to cwd). Also plait.testing's forked runs (forked_main)."""
    import runpy
    import traceback

    code = 1
    sys.path[0] = str(cwd)
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module puts the module's file first, as `python -m` has it
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)  # as `python script.py` has it; __file__ absolute, as there
            runpy.run_path(str(Path(cwd) / argv[0]), run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
    exit_without_teardown(code)
