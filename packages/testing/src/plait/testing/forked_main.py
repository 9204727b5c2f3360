"""A forked child that becomes `python ARGV`: what plait.testing.warm_cli's server and the README
blocks' server (tests/test_combo_readme_blocks.py) fork for each run, so that a run skips the
imports its server made once and is otherwise a fresh interpreter's: its working directory,
environment, stdin from /dev/null, stdout and stderr to files, `__main__`, interpreter exit
(non-daemon threads joined, atexit handlers run) and exit code."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn


def become_main(argv: list[str], cwd: str | Path, stdout: str | Path, stderr: str | Path,
                env: dict[str, str] | None = None, new_session: bool = False) -> NoReturn:
    """Run `python *argv` in this (forked) process and exit as its interpreter would.

    argv: ["-m", module, args...] or [script, args...] (a script relative to cwd). env: the whole
    environment (None: keep this one). new_session: a process group of its own, so that a caller
    can kill the run and every process it started."""
    import traceback

    try:
        if new_session:
            os.setsid()
        os.chdir(cwd)
        if env is not None:
            os.environ.clear()
            os.environ.update(env)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, stdout), (2, stderr)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
        from plait.trainer.rank_factory import run_as_main
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    run_as_main(list(argv), cwd)
