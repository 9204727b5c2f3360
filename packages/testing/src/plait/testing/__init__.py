"""plait.testing: what plait's tests run on, never imported by runtime code.

    ranks      `run_on_ranks(fn, n, ...)`: fn on n CPU ranks (gloo, spawned, bounded by a timeout, the
               first failing rank's traceback raised as RankError)
    sentinel   `StepSentinel`: host syncs and CUDA-precondition violations of a step, seen on a CPU run
    trainer    plait-train in tests: the parity flags, training in process (with a sentinel on every
               rank), the CLI in a subprocess, metrics readers (imports plait.trainer when used)
"""

from .ranks import RankError, run_on_ranks
from .sentinel import Record, StepSentinel

__version__ = "0.1.0"

__all__ = ["RankError", "Record", "StepSentinel", "__version__", "run_on_ranks"]
