"""Run a function on N ranks with gloo, for tests: on the CPU, or on CUDA with ranks sharing the GPUs.

Every package's multi-rank tests use this: each rank is a process with one intra-op thread, the
function's return values come back as a list indexed by rank, a rank's exception is re-raised in
the caller with that rank's traceback, and a run that does not finish within `timeout` is killed
and fails — a test never hangs.

With `device="cuda"` local rank r computes on `cuda:(r % GPUs)` (current device set before the
process group starts) and the collectives run on CUDA tensors through gloo, point-to-point staged
through host memory (plait.mesh.host_staging): N ranks on one GPU, which NCCL refuses.

Ranks are forked from a forkserver that has already imported torch (and DTensor, dynamo and the
trainer where installed), so a rank starts in well under a second instead of paying those imports
each time.
"""

import datetime
import os
import pickle
import queue
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def _context():
    ctx = mp.get_context("forkserver")
    # What most rank functions import (skipped where a session lacks it): each import is paid once
    # by the forkserver instead of by every rank of every spawn.
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.tensor", "torch._dynamo", "plait.testing",
                                "plait.trainer.train"])
    return ctx


def _rank_main(rank: int, world_size: int, store_path: str, payload: bytes, sys_path: list[str], results,
               device: str = "cpu") -> None:
    # The forkserver was started with an earlier sys.path; tests import their helpers by module name.
    sys.path[:] = sys_path
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    try:
        import gc

        import torch
        import torch.distributed as dist

        # The forkserver's imports (torch, DTensor, dynamo, the trainer: ~400k objects) live as
        # long as the rank: out of the collector's sight, a full collection (the parity matrix
        # runs one after each job) scans only what the rank made since, ~1 ms instead of 0.3-0.8 s.
        gc.freeze()
        torch.set_num_threads(1)
        if device == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        fn, args, kwargs = pickle.loads(payload)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120)
        )
        # Every rank past its own connectFullMesh before any may tear down: a rank whose function
        # makes no collective (and so exits at once) otherwise closed its sockets while a slower
        # peer was still connecting, and that peer failed in init ("Connection closed by peer";
        # seen once in CI on a loaded machine).
        if device == "cuda":
            from plait.mesh.host_staging import install_host_staging

            install_host_staging()
        dist.barrier()
        try:
            result = fn(rank, world_size, *args, **kwargs)
        except BaseException:
            # Report before tearing down: peers then fail with "connection reset", and the
            # parent must see the first error, not theirs.
            results.put((rank, False, traceback.format_exc(), time.time()))
            raise
        finally:
            dist.destroy_process_group()
        results.put((rank, True, pickle.dumps(result), time.time()))
    except BaseException:  # anything else (start-up, pickling), including SystemExit
        results.put((rank, False, traceback.format_exc(), time.time()))


def _first_error(results, first: tuple[float, int, str]) -> tuple[int, str]:
    """Of the errors reported within a second of the first one, the earliest: the root cause."""
    errors = [first]
    drain_until = time.monotonic() + 1.0
    while time.monotonic() < drain_until:
        try:
            rank, ok, data, when = results.get(timeout=max(0.0, drain_until - time.monotonic()))
        except queue.Empty:
            break
        if not ok:
            errors.append((when, rank, data))
    _, rank, data = min(errors)
    return rank, data


def _check_device(device: str) -> None:
    if device not in ("cpu", "cuda"):
        raise ValueError(f"run_on_ranks(device={device!r}): pick 'cpu' or 'cuda'.")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("run_on_ranks(device='cuda') needs a CUDA GPU, and this machine has none.")


def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 120.0, device: str = "cpu",
                 **kwargs: Any) -> list:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` gloo ranks; return each rank's result.

    `fn` must be importable by name (a module-level function). The process group is initialised
    before `fn` runs and destroyed after it returns. `device`: "cpu", or "cuda" (ranks share the
    machine's GPUs, see the module docstring).
    """
    _check_device(device)
    ctx = _context()
    results = ctx.Queue()
    payload = pickle.dumps((fn, args, kwargs))
    with tempfile.TemporaryDirectory(prefix="plait-ranks-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(rank, world_size, store_path, payload, list(sys.path), results, device),
                daemon=True,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcome: dict[int, Any] = {}
        deadline = time.monotonic() + timeout
        try:
            while len(outcome) < world_size:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(range(world_size)) - set(outcome))
                    raise TimeoutError(
                        f"{fn.__name__} on {world_size} ranks did not finish within {timeout:.0f} s; "
                        f"ranks still running: {missing}"
                    )
                try:
                    rank, ok, data, when = results.get(timeout=min(remaining, 1.0))
                except queue.Empty:
                    dead = [r for r, p in enumerate(procs) if r not in outcome and p.exitcode not in (None, 0)]
                    if dead:
                        raise RankError(
                            f"rank {dead[0]} of {fn.__name__} died with exit code {procs[dead[0]].exitcode}"
                        ) from None
                    continue
                if not ok:
                    rank, data = _first_error(results, (when, rank, data))
                    raise RankError(f"rank {rank} of {fn.__name__} raised:\n{data}")
                outcome[rank] = pickle.loads(data)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join(timeout=5)
    return [outcome[r] for r in range(world_size)]
