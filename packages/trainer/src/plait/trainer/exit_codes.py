"""What `plait-train` exits with, so schedulers can tell a finished run from one to requeue.

The same code is written to `<job.dump_folder>/exit_status` by whoever held the run's lock (the
plait launcher, or rank 0), because torchrun reports any failing rank as its own exit code 1:
a batch script reads the file to decide (`running` there means the run was killed before it
could write its code, which also calls for a requeue). A run that fails before it takes the lock
(its configuration) writes its code there too, unless another live run holds the folder.

Requeue (74, 75) only what a restart can cure: a rank killed from outside, a lost peer or node, a
transient I/O error, a preemption. What would fail the same way again is not requeued: a
configuration error (2), divergence (3), running out of memory (4: the same config runs out again),
a bug (1: a traceback; a collective mismatch between ranks is one), and any requeue-able failure
that happens again at the same step after the restart (5): the second time, the cause is the run's.
"""

import json
import os
import time
from pathlib import Path

from plait.mesh.errors import InfrastructureFault  # noqa: F401  (exit INFRA, whichever package raises it)

FINISHED = 0  # the run finished its training.steps (or had nothing left to train)
ERROR = 1  # an unexpected error (a bug): Python's own code for an uncaught exception, with its traceback
CONFIG = 2  # a configuration or checkpoint error, one line (also: the dump folder is in use)
DIVERGED = 3  # NaN / inf loss or grad norm; nothing non-finite was checkpointed (was 1, Python's crash code)
OUT_OF_MEMORY = 4  # device or host memory ran out: the same config runs out again (not requeued)
REPEATED = 5  # a requeue-able failure at the same step as the previous run's: not requeued again
INFRA = 74  # infrastructure fault: an I/O error (disk full, read-only), a rank died or was killed from
#             outside, a lost peer or a collective timeout: requeue, on other nodes if it repeats (EX_IOERR)
STOPPED = 75  # stopped before its last step (SIGTERM, preempted): run the same command to resume (EX_TEMPFAIL)
INTERRUPTED = 130  # Ctrl-C

REQUEUE = (INFRA, STOPPED)  # codes a scheduler requeues (and `running` in exit_status: killed outright)
NOT_REQUEUED = (ERROR, CONFIG, DIVERGED, OUT_OF_MEMORY, REPEATED, INTERRUPTED)




STATUS_FILE = "exit_status"
RUNNING = "running"


# The step each failed run was at (written by rank 0, read by whoever settles the exit code).
FAILURE_FILE = ".plait-failure.json"
# The previous settled failure: {"step": ..., "code": ...}; removed when a run finishes.
HISTORY_FILE = ".plait-failure-history.json"


def record_failure(dump_folder: str | os.PathLike, step: int, code: int) -> None:
    """Rank 0: this run failed at `step` (the step it was computing; 0 before the first) with `code`."""
    _write_json(Path(dump_folder) / FAILURE_FILE, {"step": int(step), "code": int(code), "time": time.time()})


def settle(code: int, dump_folder: str | os.PathLike, since: float) -> tuple[int, str]:
    """(the code to exit with, why it changed or ""). A requeue-able failure (INFRA) at the same
    step as the previous run's requeue-able failure becomes REPEATED; the history is updated (a
    finished run clears it). `since`: when this run started (an older failure record is not its)."""
    folder = Path(dump_folder)
    history = _read_json(folder / HISTORY_FILE)
    if code == FINISHED:
        _remove(folder / HISTORY_FILE)
        return code, ""
    if code not in (INFRA, REPEATED, OUT_OF_MEMORY, ERROR, DIVERGED):
        return code, ""  # stopped, interrupted, a configuration error: no failure history
    failure = _read_json(folder / FAILURE_FILE)
    step = failure.get("step") if failure and failure.get("time", 0) >= since else None
    why = ""
    if code == INFRA and step is not None and history and history.get("step") == step and history.get("code") in (
        INFRA, REPEATED
    ):
        code = REPEATED
        why = (f"the previous run failed at step {step} as well: the cause is the run, not the machine "
               f"(exit {REPEATED}: not requeued)")
    if step is not None:
        _write_json(folder / HISTORY_FILE, {"step": step, "code": code})
    return code, why


def _read_json(path: Path) -> dict | None:
    try:
        value = json.loads(path.read_text())
        return value if isinstance(value, dict) else None
    except (OSError, ValueError, UnicodeDecodeError):
        return None


def _write_json(path: Path, value: dict) -> None:
    try:
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(value) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass  # a failing disk must not hide the run's own failure


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def exit_without_teardown(code: int):
    """Exit with `code` as the interpreter would (non-daemon threads joined, atexit handlers run,
    output flushed), but without C++ static teardown. A rank that failed may leave its process
    group's gloo threads alive, and their destructors then abort the process ("terminate called
    without an active exception", SIGABRT): the launcher would report that instead of `code`."""
    import atexit
    import sys
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
