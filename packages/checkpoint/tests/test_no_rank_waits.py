"""No rank left waiting (issue 53, item 5): a failure on one rank of two, at each place where one
rank used to raise alone while the other waited in a collective until the timeout, now reaches
both at once with the same one-line cause: a background save whose staging raises on rank 1, a
checksum read that fails on rank 1, rank 0's choice that fails with an OSError, rank 0's publish
that fails with something other than an OSError."""

import os
from pathlib import Path
from unittest import mock

import torch

from plait.checkpoint import reader, store
from plait.checkpoint import writer as writer_module
from plait.checkpoint.writer import CheckpointWriter
from plait.testing import run_on_ranks


def _state() -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 8).state_dict()}


def _caught(fn) -> tuple[str, str] | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 (what each rank raised is the test's subject)
        return type(e).__name__, str(e)
    return None


def _inject_each(rank: int, world: int, folder: str) -> dict:
    folder = Path(folder)
    writer = CheckpointWriter(folder, run_id="r1", background=True)
    writer.save(1, _state(), {"step": 1, "model_only": False})  # a good one to resume from
    out = {}
    staging_fails = mock.patch.object(writer_module.dcp, "async_save", side_effect=MemoryError("staging: out of memory"))
    with staging_fails if rank == 1 else mock.patch.dict(os.environ):
        out["async_save"] = _caught(lambda: writer.save(2, _state(), {"step": 2, "model_only": False}, background=True))
    unreadable = mock.patch.object(store, "crc32", side_effect=OSError(5, "Input/output error"))
    with unreadable if rank == 1 else mock.patch.dict(os.environ):
        out["verify"] = _caught(lambda: reader.newest_verified(folder))
    choice_fails = mock.patch.object(store, "newest_complete", side_effect=OSError(116, "Stale file handle"))
    with choice_fails if rank == 0 else mock.patch.dict(os.environ):
        out["choose"] = _caught(lambda: reader.newest_verified(folder))
    publish_fails = mock.patch.object(store, "publish", side_effect=ValueError("a bug in publishing"))
    with publish_fails if rank == 0 else mock.patch.dict(os.environ):
        out["publish"] = _caught(lambda: writer.save(3, _state(), {"step": 3, "model_only": False}))
    writer.close()
    return out


def test_a_failure_on_one_rank_reaches_both_at_once(tmp_path):
    # 60 s, well inside the ranks' 120 s collective timeout: a rank left waiting fails this test.
    results = run_on_ranks(_inject_each, 2, str(tmp_path / "checkpoints"), timeout=60)
    expected = {
        "async_save": ("CheckpointWriteError", "staging the background save failed on rank 1: staging: out of memory"),
        "verify": ("InfrastructureFault", "cannot be read on rank 1: Input/output error"),
        "choose": ("InfrastructureFault", "could not choose a checkpoint: OSError: [Errno 116] Stale file handle"),
        "publish": ("CheckpointWriteError", "publishing failed on rank 0: ValueError: a bug in publishing"),
    }
    for case, (kind, text) in expected.items():
        caught = [r[case] for r in results]
        assert caught[0] == caught[1], (case, caught)  # the same line on both ranks
        assert caught[0] is not None and caught[0][0] == kind and text in caught[0][1], (case, caught[0])
        assert "\n" not in caught[0][1]
