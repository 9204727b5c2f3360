"""What the sentinel records and where: `Record`, the entered sentinels, the source line of a record
(the first frame outside torch, this package and the stdlib), and the per-thread switch that keeps
a check's own tensor work out of the records."""

import contextlib
import os
import sys
import threading
from typing import NamedTuple

import torch

from plait.mesh.declared_sync import current_reason


class Record(NamedTuple):
    kind: str  # e.g. "item", "tolist", "nonzero", "bool_mask_index", "python_data", "to_cpu", "sdpa", "grouped_mm"
    op: str  # the function or aten op
    where: str  # "path:line" of the first frame outside torch and this package
    detail: str

    @property
    def declared(self) -> bool:
        return self.detail.startswith("declared:")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# every module of the sentinel: its wrappers and dispatch mode are frames of no step
_THIS_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(contextlib.__file__) + os.sep
# torch frames that say nothing about who issued an op (the backward call, decorators)
_PLUMBING = ("/_dynamo/", "/autograd/", "/utils/_contextlib", "/_tensor.py", "/utils/_python_dispatch", "/_compile.py")
_local = threading.local()  # .busy: inside a recorded function
_active: list = []  # entered StepSentinels (innermost last)
_patch_lock = threading.Lock()


def _stdlib(name: str) -> bool:
    return name.startswith(_STDLIB_DIR) and "-packages" not in name


def _caller() -> tuple[str, str]:
    """(first frame outside torch / this package / the stdlib, innermost torch frame or '')."""
    frame = sys._getframe(2)
    inner_torch = ""
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(_TORCH_DIR):
            if not inner_torch and not any(part in name for part in _PLUMBING):
                inner_torch = f"torch/{name[len(_TORCH_DIR) :]}:{frame.f_lineno}"
        elif not os.path.abspath(name).startswith(_THIS_PACKAGE) and not _stdlib(name):
            short = name.split("/src/", 1)[-1] if "/src/" in name else os.path.relpath(name)
            return f"{short}:{frame.f_lineno}", inner_torch
        frame = frame.f_back
    return "<unknown>", inner_torch


def _record(kind: str, op: str, detail: str, sync: bool) -> None:
    sentinel = _active[-1] if _active else None
    if sentinel is None or not sentinel._watching_this_thread():
        return
    where, inner = _caller()
    if inner:
        detail = f"{detail} (in {inner})" if detail else f"in {inner}"
    declared = current_reason()
    if sync and declared:
        detail = f"declared: {declared}; {detail}"
    (sentinel.host_syncs if sync else sentinel.violations).append(Record(kind, op, where, detail))


def _busy() -> bool:
    return _local.__dict__.get("busy", 0) > 0


@contextlib.contextmanager
def _suppressed():
    _local.busy = _local.__dict__.get("busy", 0) + 1
    try:
        yield
    finally:
        _local.busy -= 1
