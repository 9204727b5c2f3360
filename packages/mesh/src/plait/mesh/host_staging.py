"""What gloo lacks for CUDA tensors, staged through host memory: point-to-point send and receive.

Gloo runs its collectives on CUDA tensors by copying them to pinned host memory on a side stream
and back (its *CUDAWork classes): all_reduce, broadcast, all_gather / all_gather_into_tensor,
reduce_scatter_tensor (an all-reduce of a copy: plait-dataparallel reduces with SUM on gloo),
all_to_all_single with uneven splits. Its send and recv do not: they hand the tensor's address to
the TCP transport as if it were host memory (no device check, torch 2.11-2.13), which fails or
corrupts. Pipeline stages and ring attention move CUDA tensors with isend / irecv
(batch_isend_irecv calls them one at a time on gloo), so where ranks share a GPU over gloo,
`install_host_staging()` makes torch.distributed's send, recv, isend and irecv stage CUDA tensors:

- send: the tensor is copied to pinned memory without blocking the host (on the current stream,
  so it reads the value the stream has computed); one staging thread per process waits for that
  copy and hands the host buffer to gloo, as gloo's own CUDA work does on its thread;
- receive: gloo receives into pinned memory; `wait()` waits for it and copies it to the tensor
  without blocking the host (on the stream that waits, before anything there reads it). Waiting
  on a work completes the staged works issued before it too.

Staged operations are issued in the order they were called (one thread, first in first out),
which is the order gloo matches messages between two ranks in. The training thread never blocks
on the device here; `wait()` blocks on the transfer as every gloo work's does. Anything else (CPU
tensors, other backends) goes to torch's functions unchanged. `gpu/collectives.py` records, on the
lease's GPU, which collectives gloo runs natively on CUDA tensors and that the staged ones match.
"""

import inspect
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

STAGED = ("send", "recv", "isend", "irecv")
_original: dict = {}
_state = {"stage_cpu": False, "pool": None, "staged": 0}
_lock = threading.RLock()
_outstanding: list = []  # staged works not yet completed, in the order they were issued


class StagedWork(dist.Work):
    """A staged send or receive. `wait()` completes it and every staged work issued before it in
    this process (their order on the wire): it waits for gloo's transfer of each host buffer and
    copies each received one into its tensor on the current stream. So a caller that waits only
    on the last work of a batch (some torch versions' pipeline schedules) still has all of it."""

    def __init__(self, issued: Future, tensor: torch.Tensor | None = None, host: torch.Tensor | None = None):
        super().__init__()
        self._issued, self._tensor, self._host = issued, tensor, host
        self._done = False
        self._finished = threading.Event()
        with _lock:
            _outstanding.append(self)

    def wait(self, timeout=None) -> bool:
        with _lock:
            if self not in _outstanding:  # done, or being completed by another thread's wait
                earlier = []
            else:
                position = _outstanding.index(self)
                earlier, _outstanding[: position + 1] = _outstanding[: position + 1], []
        for work in earlier:
            work._complete()
        self._finished.wait()
        return True

    def _complete(self) -> None:
        self._issued.result().wait()
        if self._tensor is not None:
            with torch.no_grad():  # a pipeline's receive buffers are leaves that require grad
                self._tensor.copy_(self._host, non_blocking=self._host.is_pinned())
        self._done = True
        self._finished.set()

    def is_completed(self) -> bool:
        return self._done

    def source_rank(self) -> int:
        return self._issued.result()._source_rank()


def _pool() -> ThreadPoolExecutor:
    with _lock:
        if _state["pool"] is None:
            _state["pool"] = ThreadPoolExecutor(max_workers=1, thread_name_prefix="plait-host-staging")
        return _state["pool"]


def _wants_staging(tensor: torch.Tensor, group) -> bool:
    if not (tensor.is_cuda or (_state["stage_cpu"] and tensor.device.type == "cpu")):
        return False
    return dist.get_backend(group) == "gloo"


def _host_like(tensor: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(tensor, device="cpu", pin_memory=tensor.is_cuda)


def _stage_send(bound: inspect.BoundArguments) -> StagedWork:
    _state["staged"] += 1
    tensor = bound.arguments["tensor"]
    host = _host_like(tensor)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    copied = None
    if tensor.is_cuda:
        copied = torch.cuda.Event()
        copied.record()
    bound.arguments["tensor"] = host

    def issue():
        if copied is not None:
            copied.synchronize()
        return _original["isend"](*bound.args, **bound.kwargs)

    return StagedWork(_pool().submit(issue))


def _stage_recv(bound: inspect.BoundArguments) -> StagedWork:
    _state["staged"] += 1
    tensor = bound.arguments["tensor"]
    host = _host_like(tensor)
    bound.arguments["tensor"] = host
    return StagedWork(_pool().submit(lambda: _original["irecv"](*bound.args, **bound.kwargs)), tensor, host)


def _wrap(name: str):
    original = _original[name]
    signature = inspect.signature(original)
    stage = _stage_send if name in ("send", "isend") else _stage_recv

    def staged(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        if not _wants_staging(bound.arguments["tensor"], bound.arguments.get("group")):
            return original(*args, **kwargs)
        work = stage(bound)
        if name.startswith("i"):
            return work
        work.wait()
        if name == "recv":
            return _received_from(bound, work)
        return None

    staged.__wrapped__ = original
    staged.__name__ = staged.__qualname__ = name
    staged.__doc__ = original.__doc__
    return staged


def _received_from(bound: inspect.BoundArguments, work: StagedWork) -> int:
    """dist.recv's return value: the sender's global rank."""
    args, group = bound.arguments, bound.arguments.get("group")
    if args.get("src") is not None:
        return args["src"]
    group_src = args.get("group_src")
    if group_src is None:
        group_src = work.source_rank()
    return dist.get_global_rank(group or c10d._get_default_group(), group_src)


def install_host_staging(stage_cpu: bool = False) -> None:
    """Stage send / recv / isend / irecv of CUDA tensors over gloo from now on, in this process
    (idempotent). `stage_cpu`: stage CPU tensors too (tests: the same path on a machine without
    a GPU, the host copy then a plain copy)."""
    with _lock:
        _state["stage_cpu"] = _state["stage_cpu"] or stage_cpu
        if _original:
            return
        for name in STAGED:
            _original[name] = getattr(c10d, name)
        for name in STAGED:
            # P2POp checks its op against distributed_c10d's isend / irecv, and batch_isend_irecv
            # calls the op it holds: both modules must hold the staged functions.
            setattr(c10d, name, _wrap(name))
            setattr(dist, name, getattr(c10d, name))


def stage_cpu_tensors(enabled: bool) -> None:
    """Tests: stage CPU tensors over gloo too (installing the staging), or stop staging them."""
    if enabled:
        install_host_staging(stage_cpu=True)
    with _lock:
        _state["stage_cpu"] = enabled


def staged_operations() -> int:
    """Sends and receives staged so far in this process."""
    return _state["staged"]


def host_staging_installed() -> bool:
    return bool(_original)
