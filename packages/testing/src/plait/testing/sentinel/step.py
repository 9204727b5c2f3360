"""`StepSentinel`: enter it around a step; it installs both layers while any sentinel is entered."""

import contextlib
import threading
from collections import Counter

import torch

from .aten import _AtenMode
from .functions import _install, _uninstall
from .records import Record, _active, _patch_lock, _suppressed


class StepSentinel:
    """Records host syncs and CUDA precondition violations; enter it once per step.

    `device`: the compute device (default: cuda when available, else cpu). Records accumulate
    over every entry; `step_counts()` gives (host_syncs, violations) per entry.
    """

    def __init__(self, device: torch.device | str | None = None, compute_dtype: torch.dtype | None = None):
        # compute_dtype (e.g. bf16): count compute kernels (matmuls, grouped_mm, SDPA) whose inputs
        # are in another dtype, in `off_dtype_kernels` {(op, where, dtypes): count}; not a
        # precondition violation (fp32 on purpose exists), the caller judges.
        self.compute_dtype = compute_dtype
        self.off_dtype_kernels: Counter = Counter()
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.host_syncs: list[Record] = []
        self.violations: list[Record] = []
        self._steps: list[tuple[int, int]] = []
        self._start: tuple[int, int] | None = None
        self._mode: _AtenMode | None = None
        self._thread: int | None = None

    def _watching_this_thread(self) -> bool:
        # The entering thread, and the autograd engine's own threads (a GPU backward runs there);
        # not other Python threads (a data prefetcher).
        current = threading.current_thread()
        return current.ident == self._thread or isinstance(current, threading._DummyThread)

    def __enter__(self) -> "StepSentinel":
        if self._start is not None:
            raise RuntimeError("StepSentinel is already entered; enter it once per step, not nested.")
        self._start = (len(self.host_syncs), len(self.violations))
        self._thread = threading.get_ident()
        with _patch_lock:
            if not _active:
                _install()
            _active.append(self)
        self._mode = _AtenMode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        self._mode = None
        with _patch_lock:
            _active.remove(self)
            if not _active:
                _uninstall()
        syncs, violations = self._start
        self._steps.append((len(self.host_syncs) - syncs, len(self.violations) - violations))
        self._start = None

    @staticmethod
    @contextlib.contextmanager
    def paused():
        """Record nothing of this thread inside (a test's own instrumentation within a step)."""
        with _suppressed():
            yield

    def step_counts(self) -> list[tuple[int, int]]:
        """(host syncs, precondition violations) for each entered step, in order."""
        return list(self._steps)

    def report(self) -> str:
        """Short text: counts grouped by (kind, where), syncs then violations."""
        lines = [f"{len(self._steps)} steps, {len(self.host_syncs)} host syncs, {len(self.violations)} violations"]
        for title, records in (("host syncs", self.host_syncs), ("precondition violations", self.violations)):
            if not records:
                continue
            lines.append(f"{title}:")
            groups = Counter((r.kind, r.where) for r in records)
            example = {}
            for r in records:
                example.setdefault((r.kind, r.where), r)
            for (kind, where), n in groups.most_common():
                r = example[(kind, where)]
                lines.append(f"  {n:5d} x {kind:<20} {where}  {r.op}: {r.detail}")
        return "\n".join(lines)
