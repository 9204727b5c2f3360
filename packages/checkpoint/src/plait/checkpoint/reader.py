"""Choose the checkpoint to resume from, the same one on every rank, after every rank verified it.

Rank 0 chooses (it alone reads the folder's markers) and broadcasts its verdict, or its
CheckpointError so that every rank fails with the same line. Then every rank hashes every
world_size-th recorded file; a damaged checkpoint is skipped (remembered in `rejected`, so a later
save never overwrites it) and the one published before it is chosen, unless the choice was
explicit (a step the user asked for): then the problem is the error.

    path, meta = newest_verified(folder)        # None, None when the folder holds no checkpoint

A chooser of one's own gets the rejected set and must skip it (`choose_verified(lambda skip:
...)`); one that offers a rejected checkpoint again is an error, not a loop.
"""

import logging
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from plait.mesh.errors import InfrastructureFault

from . import store
from .collect import all_gather, broadcast
from .store import CheckpointError

log = logging.getLogger("plait.checkpoint")


def agree(decide: Callable):
    """Run `decide()` on rank 0 and return its result on every rank, or raise what it raised on
    every rank, in one line: a CheckpointError as itself, an OSError (EIO, a stale NFS handle) as
    an InfrastructureFault, anything else as a RuntimeError. Nothing escapes rank 0 before the
    broadcast: the other ranks would wait in it until the collective timeout."""
    verdict = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            verdict = ("ok", decide())
        except Exception as e:  # noqa: BLE001 (every rank must learn it, see above)
            verdict = (_kind(e), _one_line(e))
    kind, value = broadcast(verdict)
    if kind != "ok":
        raise _ERRORS[kind](value)
    return value


_ERRORS = {"checkpoint": CheckpointError, "io": InfrastructureFault, "error": RuntimeError}


def _kind(error: Exception) -> str:
    if isinstance(error, CheckpointError):
        return "checkpoint"
    return "io" if isinstance(error, OSError) else "error"


def _one_line(error: Exception) -> str:
    if isinstance(error, CheckpointError):
        return str(error)
    text = (str(error).splitlines() or [""])[0]
    return f"checkpoint: rank 0 could not choose a checkpoint: {type(error).__name__}: {text}"


def newest_verified(folder: str | Path, rejected: set[str] | None = None) -> tuple[str | None, dict | None]:
    """The newest complete checkpoint in `folder` that every rank verified, skipping damaged ones
    (added to `rejected`); (None, None) when there is none."""
    return choose_verified(lambda skip: store.newest_complete(Path(folder), skip=skip)[:2], rejected)


def choose_verified(choose: Callable[[set[str]], tuple], rejected: set[str] | None = None,
                    explicit: str = "") -> tuple[str | None, dict | None]:
    """`choose(rejected)` (rank 0: (path or None, marker meta), skipping the paths in `rejected`)
    until every rank verified its choice; each damaged one goes into `rejected`. `explicit`: the
    setting that asked for this one checkpoint (a damaged one is then the error, with this text),
    "" to fall back to the one published before it."""
    rejected = set() if rejected is None else rejected
    while True:
        path, meta = agree(lambda: choose(rejected))
        if path is None:
            return None, None
        path = str(path)
        if path in rejected:
            raise CheckpointError(f"the chooser offered {path} again after it was found damaged: it must skip the "
                                  "paths it is given (store.newest_complete(folder, skip=rejected))")  # fmt: skip
        problem, rng_problem = verify(Path(path), meta)
        if problem is None:
            if rng_problem:
                meta = dict(meta, **{store.RNG_PROBLEM: meta.get(store.RNG_PROBLEM) or rng_problem})
            return path, meta
        if explicit:
            raise CheckpointError(f"{problem}; {explicit} asks for it: pick another step or -1 for the newest good one")
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.warning(f"skipping {problem}")
        rejected.add(path)  # on every rank: each checks `path in rejected` alike


def verify(path: Path, meta: dict) -> tuple[str | None, str | None]:
    """Every rank hashes every world_size-th recorded file; the first problem any rank found
    in the model / optimizer files, and the first in the RNG files (which alone do not reject
    a checkpoint: it resumes re-seeded). A file that cannot be read on any rank raises an
    InfrastructureFault on every rank (a requeue retries; skipping it could start the run over)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = sorted(meta.get("checksums") or {})[rank::world]
    rng_names = [n for n in names if store.is_rng_file(n)]
    rng_names = [n for n in rng_names if (Path(path) / n).is_file()]  # a missing one: check() noted it
    problem = rng_problem = unreadable = None
    try:
        problem = store.verify_checksums(path, meta, [n for n in names if not store.is_rng_file(n)])
        rng_problem = store.verify_checksums(path, meta, rng_names)
    except OSError as e:  # EIO, a stale NFS handle: the storage's fault, not the checkpoint's
        unreadable = f"checkpoint: {path} cannot be read on rank {rank}: {store.cause_of(e)}"
    gathered = all_gather((problem, rng_problem, unreadable))
    unreadable = next((u for _, _, u in gathered if u), None)
    if unreadable:  # every rank, after the gather: skipping it could start the run over
        raise InfrastructureFault(unreadable)
    return next((p for p, _, _ in gathered if p), None), next((r for _, r, _ in gathered if r), None)
