"""Every ```python block of README.md, packages/*/README.md and docs/*.md says what it is, and the
ones that say `runs:` run as printed, so none can drift from the code (issue 55):

- every block has a marker on the line before it (tools/readme_blocks.py): a new block without one
  fails here, named by file and line;
- every `runs:` block, written to block.py in an empty folder, runs as its marker says (`python
  block.py`, or `python -m torch.distributed.run --standalone --nproc-per-node N block.py`) with
  OMP_NUM_THREADS=1 and exits 0 within TIMEOUT; CHECKS holds what some must print besides (what the
  README's comments promise, or what the package test that ran the block before asserted).

The blocks run in children forked from one server process that has imported what they import
(torch, DTensor, dynamo, transformers, the plait packages): a child is `python block.py` (its own
pid, folder, stdout and stderr, `__main__`, exit code) without the ~4 s of imports (~12 s with
transformers) a fresh interpreter pays before a block's first line. The ranks a block starts
(run_on_ranks, torchrun) are fresh processes, as for a user. Two blocks run at a time, in the
tests' order. PLAIT_TEST_FRESH_CLI=1 starts a fresh interpreter for every block, one at a time.

    python tests/test_combo_readme_blocks.py serve     the server (the test starts it)
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("readme_blocks", ROOT / "tools" / "readme_blocks.py")
readme_blocks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(readme_blocks)

TIMEOUT = 120
AT_ONCE = 2  # blocks running at a time (see `runner`)
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
PRELOAD = ("torch", "torch.distributed.tensor", "torch._dynamo", "transformers",
           "transformers.models.llama.modeling_llama", "transformers.models.qwen3_moe.modeling_qwen3_moe",
           "plait.testing", "plait.models", "plait.data", "plait.checkpoint", "plait.dataparallel",
           "plait.tensorparallel", "plait.contextparallel", "plait.expertparallel", "plait.pipelineparallel",
           "plait.faulttolerance")  # fmt: skip
BLOCKS = [block for path in readme_blocks.markdown_files() for block in readme_blocks.blocks(path)]
RUNS = [block for block in BLOCKS if block.kind and block.kind.startswith("runs:")]


def _line(text: str) -> str:
    return f"^{re.escape(text)}$"


def _prints(*patterns: str):
    """Each pattern matches somewhere in stdout (re.M: ^ and $ at each line)."""

    def check(out: str) -> None:
        for pattern in patterns:
            if not re.search(pattern, out, re.M):
                raise AssertionError(f"no line matches {pattern!r}")

    return check


def _losses_fall(pattern: str, count: int):
    """`count` losses (the pattern's group `loss`) per key (its group `key`, if any), the last below
    the first. Unanchored: the lines of two processes may interleave."""

    def check(out: str) -> None:
        losses = {}
        for match in re.finditer(pattern, out):
            losses.setdefault(match.groupdict().get("key"), []).append(float(match["loss"]))
        if not losses or not all(len(v) == count and v[-1] < v[0] for v in losses.values()):
            raise AssertionError(f"not {count} losses each, the last below the first: {losses}")

    return check


def _pipeline_losses_fall(out: str) -> None:
    first, last = ast.literal_eval(out.strip().splitlines()[-1])  # [rank 0's, rank 1's]
    if first != [None] * 3 or not last[-1] < last[0]:
        raise AssertionError(f"not [[None] * 3, 3 falling losses]: {[first, last]}")


# (file, a line of the block) -> what its stdout must show, besides the exit code 0.
CHECKS = {
    ("packages/checkpoint/README.md", "hf_export.export("): [_prints(r"'config\.json', 'model\.safetensors'\] True$")],
    ("packages/data/README.md", "print(step, loss.item())"): [_losses_fall(r"(?m)^\d+ (?P<loss>[\d.]+)$", 3)],
    ("packages/models/README.md", 'build_model("llama3", "debugmodel")'): [_prints(r"\['layers\.0', 'layers\.1'")],
    ("packages/testing/README.md", "StepSentinel()"): [
        _prints(r"\A" + _line("[(2, 0)]"), "declared: logging the loss")
    ],
    ("packages/faulttolerance/README.md", "start_lighthouse("): [
        _prints(_line("exit codes [0, 0]")),
        _losses_fall(r"group (?P<key>\d) step \d+ groups 2 loss (?P<loss>[\d.]+)", 5),
    ],
    ("packages/mesh/README.md", "except ParallelConfigError"): [
        _prints(_line("4 2 4"), "^" + re.escape("parallelism.ep = 3 must divide dp_shard * cp = 4"))
    ],
    ("packages/mesh/README.md", "comm_problem("): [_prints("NCCL refuses two ranks on one GPU")],
    ("packages/expertparallel/README.md", "StackedExperts(moe.experts)"): [
        _prints(_line("[(torch.Size([2, 32, 16]), tensor(True)), (torch.Size([2, 32, 16]), tensor(True))]"))
    ],
    ("packages/expertparallel/README.md", "adapt_transformers_experts(model)"): [
        _prints(_line("[(torch.Size([2, 64, 64]), True), (torch.Size([2, 64, 64]), True)]"))
    ],
    ("packages/pipelineparallel/README.md", "split_user_model("): [_pipeline_losses_fall],
}


def _checked_block(file: str, line: str) -> readme_blocks.Block:
    found = [b for b in RUNS if b.where.startswith(f"{file}:") and line.strip() in b.code]
    assert len(found) == 1, f"CHECKS: {len(found)} `runs:` blocks of {file} hold {line!r}: make it name one"
    return found[0]


def test_every_python_block_has_a_marker():
    missing = [f"{b.where}: a ```python block with no `<!-- runs: python -->`, `<!-- runs: torchrun N -->` or "
               f"`<!-- fragment: why -->` on the line before it" for b in BLOCKS if b.kind is None]  # fmt: skip
    assert not missing, "\n".join(missing)


def test_blocks_finds_markers_fences_and_indented_blocks(tmp_path):
    (tmp_path / "README.md").write_text(
        "# t\n\n<!-- runs: torchrun 2 -->\n```python\nprint(1)\n```\n\n```bash\npython -c 'print(2)'\n```\n\n"
        "- a list item:\n\n  <!-- fragment: names x -->\n  ```python\n  x + 1\n  ```\n\n"
        "<!-- runs: node -->\n```python\npass\n```\n"
    )  # fmt: skip
    got = [(b.line, b.kind, b.ranks, b.code) for b in readme_blocks.blocks(tmp_path / "README.md")]
    # The bash block is no block; the list item's is dedented; a marker it does not know is none.
    assert got == [(4, "runs: torchrun 2", 2, "print(1)\n"), (15, "fragment: names x", None, "x + 1\n"),
                   (20, None, None, "pass\n")]  # fmt: skip


def test_every_check_names_one_block():
    for file, line in CHECKS:
        _checked_block(file, line)


@pytest.mark.timeout(2 * TIMEOUT + 60)  # it may wait for the block started before it
@pytest.mark.parametrize("block", RUNS, ids=[b.where for b in RUNS])
def test_block_runs_as_printed(block, runner):
    code, out, err = runner(block)
    assert code == 0, f"{block.where} ({block.kind}) exited {code}:\n{out[-3000:]}\n{err[-5000:]}"
    for (file, line), checks in CHECKS.items():
        if _checked_block(file, line) == block:
            for check in checks:
                try:
                    check(out)
                except AssertionError as e:
                    raise AssertionError(f"{block.where} printed what CHECKS rejects ({e}):\n{out[-3000:]}") from None


def _argv(block: readme_blocks.Block) -> list[str]:
    if block.ranks is None:
        return ["block.py"]
    return ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(block.ranks), "block.py"]


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    """`run(block) -> (exit code, stdout, stderr)`, the block run as `python *_argv(block)` in a
    folder holding only block.py. AT_ONCE blocks run at a time, in the session's order: while a
    test waits for its block, the next one starts (its imports overlap the other's ranks)."""
    order = [item.callspec.params["block"] for item in request.session.items
             if getattr(item, "originalname", None) == "test_block_runs_as_printed"]  # fmt: skip
    server = None if os.environ.get("PLAIT_TEST_FRESH_CLI") == "1" else _start_server()
    started = {}  # block -> (pid, folder, deadline)

    def folder_for(block) -> Path:
        folder = tmp_path_factory.mktemp("block") / "cwd"  # its output and exit code go next to it
        folder.mkdir()
        (folder / "block.py").write_text(block.code)
        return folder

    def start(block) -> None:
        folder = folder_for(block)
        server.stdin.write(json.dumps({"argv": _argv(block), "cwd": str(folder)}) + "\n")
        server.stdin.flush()
        started[block] = (int(server.stdout.readline()), folder, time.monotonic() + TIMEOUT)

    def running() -> list:
        return [b for b, (_, folder, _) in started.items() if not (folder.parent / "status").exists()]

    def run(block) -> tuple[int, str, str]:
        if server is None:
            return _run_fresh(_argv(block), folder_for(block))
        if block not in started:
            start(block)
        for ahead in order[order.index(block) + 1 :] if block in order else []:
            if len(running()) >= AT_ONCE:
                break
            if ahead not in started:
                start(ahead)
        pid, folder, deadline = started[block]
        status, killed = folder.parent / "status", ""
        while not status.exists():
            if not killed and time.monotonic() > deadline:
                killed = f"\nkilled after {TIMEOUT} s"
                with contextlib.suppress(ProcessLookupError):  # the block and what it started: its process group
                    os.killpg(pid, signal.SIGKILL)
            time.sleep(0.05)
        out, err = ((folder.parent / name).read_text(errors="replace") for name in ("stdout", "stderr"))
        return int(status.read_text()), out, err + killed

    yield run
    if server is not None:
        for block in running():  # started for a test that did not come (an interrupted session)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(started[block][0], signal.SIGKILL)
        server.kill()
        server.wait()


def _run_fresh(argv: list[str], folder: Path) -> tuple[int, str, str]:
    try:
        done = subprocess.run([sys.executable, *argv], cwd=folder, env=ENV, stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=TIMEOUT)  # fmt: skip
    except subprocess.TimeoutExpired as e:
        return -9, _text(e.stdout), f"{_text(e.stderr)}\nkilled after {TIMEOUT} s"
    return done.returncode, done.stdout, done.stderr


def _text(data) -> str:
    return data.decode(errors="replace") if isinstance(data, bytes) else data or ""


def _start_server() -> subprocess.Popen | None:
    server = subprocess.Popen([sys.executable, __file__, "serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              env=ENV, text=True, bufsize=1)  # fmt: skip
    atexit.register(server.kill)
    if server.stdout.readline().strip() == "ready":
        return server
    server.kill()
    return None  # threads after the imports: a fork would not be a fresh start, so fresh interpreters


def _serve() -> None:
    """Import PRELOAD, say `ready`; then per request line (argv, cwd) fork a child that runs
    `python *argv` in cwd (stdout and stderr to files next to cwd) and reply with its pid; once a
    child is reaped, write its exit code next to its cwd, in `status`. Ends with its stdin."""
    import importlib
    import select
    import threading

    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # not installed here: a block that needs it imports it (and fails as a user's would)
    print("ready" if threading.active_count() == 1 else "refused", flush=True)
    children = {}  # pid -> the folder its status goes to
    while True:
        if select.select([sys.stdin], [], [], 0.05)[0]:  # one line at a time: the client awaits each reply
            line = sys.stdin.readline()
            if not line:
                return
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _child(request["argv"], Path(request["cwd"]))
            children[pid] = Path(request["cwd"]).parent
            print(pid, flush=True)
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                io = children.pop(pid)
                (io / "status.tmp").write_text(str(os.waitstatus_to_exitcode(status)))
                os.replace(io / "status.tmp", io / "status")


def _child(argv: list[str], cwd: Path) -> None:
    """Become `python *argv` in cwd, in a process group of its own (a timeout kills the block and
    what it started); never returns."""
    from plait.testing.forked_main import become_main

    become_main(argv, cwd, cwd.parent / "stdout", cwd.parent / "stderr", new_session=True)


if __name__ == "__main__" and sys.argv[1:] == ["serve"]:
    _serve()
