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

from . import store
from .collect import all_gather, broadcast
from .store import CheckpointError

log = logging.getLogger("plait.checkpoint")


def agree(decide: Callable):
    """Run `decide()` on rank 0 and return its result on every rank, or raise its CheckpointError
    on every rank."""
    verdict = None
    if not dist.is_initialized() or dist.get_rank() == 0:
        try:
            verdict = ("ok", decide())
        except CheckpointError as e:
            verdict = ("error", str(e))
    kind, value = broadcast(verdict)
    if kind == "error":
        raise CheckpointError(value)
    return value


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
    a checkpoint: it resumes re-seeded)."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = sorted(meta.get("checksums") or {})[rank::world]
    rng_names = [n for n in names if store.is_rng_file(n)]
    rng_names = [n for n in rng_names if (Path(path) / n).is_file()]  # a missing one: check() noted it
    problem = store.verify_checksums(path, meta, [n for n in names if not store.is_rng_file(n)])
    rng_problem = store.verify_checksums(path, meta, rng_names)
    gathered = all_gather((problem, rng_problem))
    return next((p for p, _ in gathered if p), None), next((r for _, r in gathered if r), None)
