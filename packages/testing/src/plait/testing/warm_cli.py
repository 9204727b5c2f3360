"""`python -m plait.trainer ARGS` for tests, forked from a process that has already imported it.

A fresh interpreter spends ~7 s of a short CPU run importing torch, DTensor, dynamo and datasets
before plait-train's first line runs, and the suites run plait-train a few hundred times. So
`run_cli` asks one server process (per test session) that imported all of that once to fork a
child for each run. The child is the run, as a fresh `python -m plait.trainer` would be: its own
pid, environment, working directory, stdin from /dev/null, stdout and stderr to files, interpreter
exit (threads joined, atexit handlers run), and its exit code (a signal's negative number, as
subprocess reports it).

What a fork cannot give is what the interpreter reads at start-up or at import (OpenMP's and
torch's variables): a server serves only runs whose environment matches the one it started with,
except for the variables read while running (PLAIT_*, RUNTIME_ONLY). A run with another
environment gets a server of its own (the last two are kept). PLAIT_TEST_FRESH_CLI=1 starts a
fresh interpreter for every run.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# Imported once by the server; a child finds them in sys.modules.
PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "datasets", "plait.trainer.cli",
           "plait.trainer.train", "plait.trainer.validate")
# Read when used, not at import: a run may differ from its server in these (tests' in-process
# runs leave CUBLAS_WORKSPACE_CONFIG and the launcher's settings in the test process's environment).
RUNTIME_ONLY = {"CUBLAS_WORKSPACE_CONFIG", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "GLOO_SOCKET_IFNAME", "MASTER_ADDR",
                "MASTER_PORT", "TORCHFT_LIGHTHOUSE"}
KEPT_SERVERS = 2
_lock = threading.Lock()
_servers: dict[frozenset, dict] = {}  # import-time environment -> server, oldest use first


def import_environment(env: dict[str, str]) -> dict[str, str]:
    """The part of `env` a server must have started with to serve a run with `env`."""
    return {k: v for k, v in env.items() if not k.startswith("PLAIT_") and k not in RUNTIME_ONLY}


def _server_for(env: dict[str, str]) -> dict:
    key = frozenset(import_environment(env).items())
    server = _servers.pop(key, None)
    if server is None or server["proc"].poll() is not None:
        server = _start(dict(key))
    _servers[key] = server  # the newest use last
    while len(_servers) > KEPT_SERVERS:
        oldest = _servers.pop(next(iter(_servers)))
        oldest["proc"].stdin.close()  # it exits once its running children have
    return server


def _start(env: dict[str, str]) -> dict:
    proc = subprocess.Popen(
        [sys.executable, "-c", "from plait.testing.warm_cli import serve; serve()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
    )  # fmt: skip
    atexit.register(proc.kill)
    ready = proc.stdout.readline().strip()
    return {"proc": proc, "ok": ready == "ready"}


def _fork(argv: list[str], env: dict[str, str], fifos: bool) -> tuple[int, Path] | None:
    """Have a warm server fork the run: its pid and the folder of its out / err (FIFOs if `fifos`)
    and status files; None under PLAIT_TEST_FRESH_CLI=1 or where no server could start."""
    if os.environ.get("PLAIT_TEST_FRESH_CLI") == "1":
        return None
    with _lock:
        server = _server_for(env)
        if not server["ok"]:
            return None
        folder = Path(tempfile.mkdtemp(prefix="plait-cli-"))
        for name in ("out", "err") if fifos else ():
            os.mkfifo(folder / name)
        request = dict(argv=argv, env=env, cwd=os.getcwd(), stdout=str(folder / "out"), stderr=str(folder / "err"),
                       status=str(folder / "status"))  # fmt: skip
        server["proc"].stdin.write(json.dumps(request) + "\n")
        server["proc"].stdin.flush()
        return int(server["proc"].stdout.readline()), folder


def run_warm(argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess | None:
    """Run `python -m plait.trainer *argv` as a child of a warm server started with `env`'s
    import-time part; None under PLAIT_TEST_FRESH_CLI=1 or where no server could start."""
    forked = _fork(argv, env, fifos=False)
    if forked is None:
        return None
    pid, folder = forked
    status, deadline = folder / "status", time.monotonic() + timeout
    try:
        while not status.exists():
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                raise subprocess.TimeoutExpired(["plait-train", *argv], timeout, _read(folder / "out"),
                                                _read(folder / "err"))  # fmt: skip
            time.sleep(0.05)
        return subprocess.CompletedProcess(
            [sys.executable, "-m", "plait.trainer", *argv], int(status.read_text()), _read(folder / "out"),
            _read(folder / "err"),
        )  # fmt: skip
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # this call's own mkdtemp folder


def start_warm(argv: list[str], env: dict[str, str]) -> WarmProcess | None:
    """`python -m plait.trainer *argv` forked by a warm server, running in the background: a
    Popen-like handle whose stdout and stderr are pipes (FIFOs) as with `stdout=PIPE, text=True`.
    None where run_warm would give None."""
    forked = _fork(argv, env, fifos=True)
    if forked is None:
        return None
    pid, folder = forked
    return WarmProcess(["plait-train", *argv], pid, folder)


class WarmProcess:
    """What subprocess.Popen gives for a run, for one a warm server forked: pid, stdout, stderr,
    returncode, poll, wait, communicate, send_signal, terminate, kill."""

    def __init__(self, args: list[str], pid: int, folder: Path):
        self.args, self.pid, self.folder, self.returncode = args, pid, folder, None
        # The child opens them for writing first thing (plait.testing.forked_main): these opens
        # return then, in the same order.
        self.stdout = open(folder / "out")  # noqa: SIM115  (closed by communicate / the handle's end)
        self.stderr = open(folder / "err")  # noqa: SIM115

    def poll(self) -> int | None:
        status = self.folder / "status"
        if self.returncode is None and status.exists():
            self.returncode = int(status.read_text())
            shutil.rmtree(self.folder, ignore_errors=True)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            time.sleep(0.05)
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Read both pipes to their end (the run's exit), then wait for the exit code."""
        outputs = {}

        def drain(name: str) -> None:
            stream = getattr(self, name)
            outputs[name] = stream.read()
            stream.close()

        readers = [threading.Thread(target=drain, args=(name,), daemon=True) for name in ("stdout", "stderr")]
        for reader in readers:
            reader.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        for reader in readers:
            reader.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()) + 5)
        return outputs["stdout"], outputs["stderr"]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, signum)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(15)

    def kill(self) -> None:
        self.send_signal(9)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def serve() -> None:
    """The server: import PRELOAD, say `ready`, then fork one child per request line on stdin
    and write its pid; write each child's exit code to its status file once reaped."""
    import importlib

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a package this session did not install: the child imports what it needs
    if threading.active_count() > 1:  # forking a threaded process is not a fresh start
        print(f"refused: {threading.active_count()} threads after the imports", flush=True)
        return
    # The imports live as long as every child: frozen, a child's collections never scan them
    # (and never write to their pages, which the fork shares).
    import gc

    gc.freeze()
    replies = sys.stdout
    print("ready", flush=True)
    children: dict[int, str] = {}
    pending = b""
    while True:
        if select.select([0], [], [], 0.05)[0]:
            data = os.read(0, 1 << 16)
            if not data:  # the test session ended, or this server was replaced: finish the runs
                while children:
                    time.sleep(0.05)
                    _reap(children)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                replies.flush()
                pid = os.fork()
                if pid == 0:
                    _child(request)
                children[pid] = request["status"]
                replies.write(f"{pid}\n")
                replies.flush()
        _reap(children)


def _reap(children: dict[int, str]) -> None:
    for pid in list(children):
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            path = children.pop(pid)
            code = os.waitstatus_to_exitcode(status)
            Path(path + ".tmp").write_text(str(code))
            os.replace(path + ".tmp", path)


def _child(request: dict) -> None:
    """Become `python -m plait.trainer ARGV` and exit as its interpreter would; never returns."""
    from .forked_main import become_main

    become_main(["-m", "plait.trainer", *request["argv"]], request["cwd"], request["stdout"], request["stderr"],
                env=request["env"])
