"""The checkpoint folder in one process: completion markers, validation of damaged checkpoints,
choosing the newest complete one, pruning, stale temporaries, metrics on resume, config checks."""

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from plait.checkpoint import store
from plait.checkpoint.store import CheckpointError
from plait.trainer.config import ConfigError, build_config
from plait.trainer.metrics import _open_jsonl
from plait.trainer.validate import validate


def save(folder, step, run_id="aaaa", publish=True):
    tmp = store.temp_path(folder, step, run_id)
    state = {"model": {"w": torch.full((64, 64), float(step))}, "train_state": json.dumps({"step": step})}
    with store.single_process_quiet():
        dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
    if not publish:
        return tmp
    store.write_marker(tmp, {"step": step})
    store.publish(tmp, folder / store.step_name(step))
    return folder / store.step_name(step)


def test_a_published_checkpoint_checks_and_lists(tmp_path):
    path = save(tmp_path, 5)
    meta = store.check(path)
    assert meta["step"] == 5 and {".metadata", "__0_0.distcp"} <= meta["files"].keys()
    assert store.checkpoints(tmp_path) == [(5, path)]
    save(tmp_path, 5)  # saving the same step again replaces it
    assert store.checkpoints(tmp_path) == [(5, path)] and store.check(path)["step"] == 5


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: (p / ".complete").unlink(), "is incomplete: no .complete marker"),
        (lambda p: (p / ".complete").write_text("{not json"), "its .complete marker is unreadable"),
        (lambda p: (p / "__0_0.distcp").unlink(), "is corrupt: __0_0.distcp is missing"),
        (lambda p: open(p / "__0_0.distcp", "r+b").truncate(10), "__0_0.distcp has 10 bytes"),
        (lambda p: (p / ".metadata").write_bytes(b"x" * (p / ".metadata").stat().st_size), ".metadata is unreadable"),
    ],
    ids=["no-marker", "bad-marker", "missing-data", "truncated-data", "garbage-metadata"],
)
def test_damaged_checkpoints_are_named_and_skipped(tmp_path, damage, message):
    older = save(tmp_path, 5)
    newer = save(tmp_path, 10)
    damage(newer)
    with pytest.raises(CheckpointError, match=message) as error:
        store.check(newer)
    assert str(newer) in str(error.value)
    path, meta, warnings = store.newest_complete(tmp_path)
    assert path == older and meta["step"] == 5
    assert len(warnings) == 1 and str(newer) in warnings[0] and message in warnings[0]


def test_unpublished_saves_are_never_candidates_and_are_cleaned_up(tmp_path):
    save(tmp_path, 5)
    dead = save(tmp_path, 10, run_id="dead", publish=False)  # a process died before the rename
    mine = save(tmp_path, 15, run_id="beef", publish=False)  # this run's save in flight
    assert [s for s, _ in store.checkpoints(tmp_path)] == [5]
    assert store.newest_complete(tmp_path)[0].name == "step-000005"
    assert store.remove_stale_temporaries(tmp_path, "beef") == [dead]
    assert not dead.exists() and mine.exists()


def test_prune_keeps_the_newest_complete(tmp_path):
    for step in (5, 10, 15, 20):
        save(tmp_path, step)
    (tmp_path / "step-000020" / ".complete").unlink()  # incomplete ones are not counted or deleted
    removed = store.prune(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["step-000005"]
    assert [s for s, _ in store.checkpoints(tmp_path)] == [10, 15, 20]
    assert store.prune(tmp_path, keep_last=0) == []


def test_metrics_on_resume_keep_earlier_steps_and_drop_later_ones(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [json.dumps({"step": s, "loss": s}) + "\n" for s in range(1, 13)]
    rows.insert(3, '{"step": 3, "note": "caf\xe9"}\n')  # a damaged line (not UTF-8) must not block the resume
    path.write_bytes("".join(rows[:3]).encode() + rows[3].encode("latin-1") + "".join(rows[4:]).encode() + b'{"step": 1')
    with _open_jsonl(str(path), start_step=10) as f:
        f.write(json.dumps({"step": 11, "loss": 0}) + "\n")
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 12))
    _open_jsonl(str(path), start_step=0).close()  # a new run starts a new file
    assert path.read_text() == ""


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ({"checkpoint.create_seed_checkpoint": "true"}, 2, "runs on one process, not 2"),
        ({"checkpoint.interval": "5"}, 1, "checkpoint.interval = 5 but checkpoint.enable = false"),
        ({"checkpoint.load_step": "3"}, 1, "checkpoint.load_step = 3 but checkpoint.enable = false"),
        ({"checkpoint.initial_load_hf": "true"}, 1, "needs checkpoint.initial_load_path"),
        ({"checkpoint.initial_load_path": "/no/such/dir"}, 1, "'/no/such/dir': no such folder"),
        ({"checkpoint.enable": "true", "checkpoint.load_step": "-2"}, 1, "checkpoint.load_step = -2"),
    ],
)
def test_checkpoint_settings_are_checked_up_front(overrides, world_size, message):
    config = build_config(None, list(overrides.items()))
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=world_size)


def test_checksums_catch_flipped_bytes_and_an_unreadable_rng_file(tmp_path):
    path = store.temp_path(tmp_path, 5, "aaaa")
    state = {"model": {"w": torch.full((64, 64), 5.0)}}
    with store.single_process_quiet():
        dcp.save(state, checkpoint_id=str(path), no_dist=True)
    from plait.checkpoint.state import load_rng, save_rng

    save_rng(path, 0)
    names = store.owned_files(path, rank=0, world_size=1)
    assert set(names) == {".metadata", "__0_0.distcp", "rng-rank00000.pt"}
    assert store.owned_files(path, rank=1, world_size=2) == []  # rank 1 wrote nothing here
    store.write_marker(path, {"step": 5}, store.checksums(path, names))
    meta = store.read_marker(path)
    assert store.verify_checksums(path, meta) is None
    rng = path / "rng-rank00000.pt"
    data = bytearray(rng.read_bytes())
    data[10:30] = bytes(20)
    rng.write_bytes(bytes(data))  # same size: check() passes, the checksum does not
    store.check(path)
    assert "rng-rank00000.pt does not match its checksum" in store.verify_checksums(path, meta)
    with pytest.raises(CheckpointError, match="rng-rank00000.pt is unreadable"):
        load_rng(path, 0)  # not a raw UnpicklingError


def test_newest_and_pruning_follow_publication_order_not_steps(tmp_path):
    for step in (10, 15, 20):
        save(tmp_path, step)
    for published, step in enumerate((10, 15, 20, 12), start=1):  # a run rolled back to 10 saved 12
        if step == 12:
            save(tmp_path, 12)
        marker = tmp_path / store.step_name(step) / store.MARKER
        marker.write_text(json.dumps(dict(json.loads(marker.read_text()), published=published)))
    assert store.next_publication(tmp_path) == 5
    assert store.newest_complete(tmp_path)[0].name == "step-000012"
    assert [p.name for p in store.prune(tmp_path, keep_last=2)] == ["step-000010", "step-000015"]
    assert [s for s, _ in store.checkpoints(tmp_path)] == [12, 20]
    skip = set()
    (tmp_path / "step-000012" / "__0_0.distcp").unlink()
    path, _, warnings = store.newest_complete(tmp_path, skip=skip)
    assert path.name == "step-000020" and skip == {str(tmp_path / "step-000012")} and len(warnings) == 1


def test_run_lock_refuses_a_live_holder_and_takes_over_a_dead_one(tmp_path):
    import os
    import subprocess
    import sys

    from plait.trainer.run_lock import RunLock

    lock = RunLock(str(tmp_path))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock.path.write_text(json.dumps({"pid": live.pid, "host": lock.owner["host"], "since": "then"}))
        with pytest.raises(ConfigError, match=f"is in use by another run \\(pid {live.pid} on "):
            lock.acquire()
        other_host = {"pid": live.pid, "host": "elsewhere"}
        lock.path.write_text(json.dumps(other_host))
        with pytest.raises(ConfigError, match="on elsewhere"):
            lock.acquire()
    finally:
        live.kill()
        live.wait()
    lock.path.write_text(json.dumps({"pid": live.pid, "host": lock.owner["host"]}))  # now dead
    assert "stale lock" in lock.acquire()
    assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert (tmp_path / "exit_status").read_text() == "running\n"  # what a SIGKILLed run leaves
    lock.release(75)
    assert not lock.path.exists() and (tmp_path / "exit_status").read_text() == "75\n"


def test_a_failed_write_names_its_cause_and_rank():
    """DCP's CheckpointException of a 2-rank save names the ranks only ("CheckpointException
    ranks:dict_keys([1])"): the line must say why, and where (issue 40 fault probe 8)."""
    import errno

    from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception

    def failed(exc):
        try:
            raise exc
        except Exception as e:
            return CheckpointException("CheckpointException ranks:dict_keys([1])", {1: _wrap_exception(e)})

    full = failed(OSError(errno.ENOSPC, "No space left on device", "/ckpt/__1_0.distcp"))
    assert store.cause_of(full) == "No space left on device (/ckpt/__1_0.distcp) on rank 1"
    zip_writer = failed(RuntimeError("[enforce fail at inline_container.cc:664] . PytorchStreamWriter failed "
                                     "writing file data/0: file write failed"))
    assert store.cause_of(zip_writer).startswith("RuntimeError: [enforce fail")
    assert store.cause_of(zip_writer).endswith("file write failed (the disk full?) on rank 1")
