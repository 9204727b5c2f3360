"""Issue 27's checkpoint defects, each reproduced with real files (one short CLI run shared by all):
an export never deletes what it did not write, a run never restarts silently over checkpoints it
cannot resume, model overrides are recorded, write failures are one line, two runs never share
a checkpoint folder."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from plait.checkpoint import hf_output, store
from plait.testing.trainer import cli_env, rank_pids, run_cli, start_two_ranks
from plait.trainer.checkpoint import hf_export

# fmt: off
TINY = [
    "--model.n_layers", "2", "--model.rope_theta", "12345",
    "--training.seq_len", "64", "--training.local_batch_size", "2",
    "--training.dtype", "float32", "--training.deterministic", "true",
    "--metrics.cpu_peak_tflops", "0.1", "--metrics.tensorboard", "false", "--metrics.progress_bar", "false",
    "--metrics.log_freq", "1", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
]
# fmt: on


def run(dump: Path, *args, expect=0, env=None) -> subprocess.CompletedProcess:
    return run_cli(dump, *TINY, *args, expect=expect, env=env)


def one_error_line(result, prefix="plait-train: error: ") -> str:
    err = result.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0 and err.startswith(prefix), err
    return err


def listing(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A run of 2 steps of a 2-layer debug model (rope_theta 12345), a checkpoint after each."""
    dump = tmp_path_factory.mktemp("trained") / "run"
    run(dump, "--training.steps", "2")
    return dump


def copy_run(trained: Path, tmp_path: Path) -> Path:
    import shutil

    dump = tmp_path / "run"
    shutil.copytree(trained, dump)
    return dump


def export_cli(checkpoint: Path, output: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "plait.trainer.checkpoint.hf_export", "--checkpoint", str(checkpoint),
         "--output", str(output), "--dtype", "float32"],
        capture_output=True, text=True, timeout=120, env=cli_env(),
    )  # fmt: skip


# ---- 1. an export never deletes what it did not write --------------------------------------------


def test_export_refuses_the_run_the_checkpoint_and_foreign_folders_and_changes_nothing(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    checkpoint = dump / "checkpoints" / "step-000002"
    foreign = tmp_path / "photos"
    foreign.mkdir()
    (foreign / "cat.jpg").write_bytes(b"meow")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    before_run, before_foreign = listing(dump), listing(foreign)
    # The command first, as a user runs it: a subprocess, one line, exit 2.
    result = export_cli(checkpoint, dump)
    assert result.returncode == 2 and "Traceback" not in result.stderr  # (runpy's warning: the noise list)
    assert "is or holds" in result.stderr.strip().splitlines()[-1]
    cases = {
        dump / "checkpoints": "is or holds",
        checkpoint: "is or holds",
        checkpoint / "hf": "inside the checkpoint",
        foreign: "no hf_export wrote",
        a_file: "not a folder",
        dump / "checkpoints" / "step-000009": "named like a checkpoint",
    }
    for output, message in cases.items():
        code = hf_export.main(["--checkpoint", str(checkpoint), "--output", str(output), "--dtype", "float32"])
        assert code == 2, output
        with pytest.raises(store.CheckpointError, match=message):
            hf_output.check_output(output, "--output", protected=[checkpoint])
    assert listing(dump) == before_run and listing(foreign) == before_foreign and a_file.read_text() == "mine"
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_export_writes_new_folders_and_replaces_only_its_own(trained, tmp_path, capsys):
    checkpoint = trained / "checkpoints" / "step-000002"
    out = tmp_path / "hf"
    # A 2-layer checkpoint exports with its recorded model arguments (defect 7).
    assert hf_export.main(["--checkpoint", str(checkpoint), "--output", str(out), "--dtype", "float32"]) == 0
    marker = json.loads((out / hf_output.EXPORT_MARKER).read_text())
    assert marker["step"] == 2 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 12345
    assert "config.json" in marker["files"]  # the marker lists what the export wrote
    # A shard the earlier export wrote (listed in its marker) and files a user added since.
    (out / "stale-shard.safetensors").write_text("from the earlier export")
    marker["files"].append("stale-shard.safetensors")
    (out / hf_output.EXPORT_MARKER).write_text(json.dumps(marker))
    (out / "README.md").write_text("model card")
    (out / "eval").mkdir()
    (out / "eval" / "results.json").write_text("{}")
    assert hf_export.main(["--checkpoint", str(trained / "checkpoints" / "step-000001"), "--output", str(out)]) == 0
    assert json.loads((out / hf_output.EXPORT_MARKER).read_text())["step"] == 1
    assert not (out / "stale-shard.safetensors").exists()  # what the earlier export wrote was replaced
    assert (out / "README.md").read_text() == "model card"  # what the user added was kept (defect 1)
    assert (out / "eval" / "results.json").read_text() == "{}"
    assert "kept 2 file(s)" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert hf_export.main(["--checkpoint", str(checkpoint), "--output", str(empty)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "hf"]  # no temporaries left


def test_publish_rechecks_the_output_and_the_sharded_export_refuses_foreign_folders(tmp_path):
    import torch

    from plait.checkpoint import hf_sharded
    from plait.models import get_model_spec

    (tmp_path / "a-file").write_text("x")  # --output A/B with A a file (fault probe 12): one line
    with pytest.raises(store.CheckpointError, match="which is a file, not a folder"):
        hf_output.check_output(tmp_path / "a-file" / "hf", "--output")
    (tmp_path / "a-file").unlink()
    out = tmp_path / "hf"
    tmp = hf_output.make_temp(out, {})
    out.mkdir()
    (out / "precious.txt").write_text("x")  # appeared while the export was being written
    with pytest.raises(store.CheckpointError, match="no hf_export wrote"):
        hf_output.publish(tmp, out, "--output")
    assert (out / "precious.txt").read_text() == "x"
    hf_output.discard(tmp)
    spec = get_model_spec("llama3")
    import dataclasses

    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=1, dim=64, n_heads=4, n_kv_heads=4)
    model = spec.model_cls(args)
    with pytest.raises(store.CheckpointError, match="checkpoint.last_save_in_hf.*no hf_export wrote"):
        hf_sharded.export_hf_sharded(model, out, "llama3", "debugmodel", torch.float32, args)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"] and (out / "precious.txt").read_text() == "x"
    written = hf_sharded.export_hf_sharded(model, tmp_path / "new", "llama3", "debugmodel", torch.float32, args)
    assert hf_output.is_our_export(written) and (written / "config.json").is_file()


# ---- 2. no silent restart over checkpoints that cannot be resumed ------------------------------


def flip(file: Path) -> None:
    """Damage a file in place, keeping its size: only the checksum can tell."""
    data = bytearray(file.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


def test_damaged_rng_files_resume_reseeded(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    for step in (1, 2):
        flip(dump / "checkpoints" / store.step_name(step) / "rng-rank00000.pt")
    rows_before = (dump / "metrics.jsonl").read_text().splitlines()
    result = run(dump, "--training.steps", "3")
    assert "resuming from" in result.stdout and "step-000002 (step 2" in result.stdout, result.stdout
    assert "re-seeded from job.seed + 2" in result.stdout and "rng-rank00000.pt does not match" in result.stdout
    rows = (dump / "metrics.jsonl").read_text().splitlines()
    assert rows[:2] == rows_before and [json.loads(r)["step"] for r in rows] == [1, 2, 3]


def test_no_fresh_start_over_damaged_checkpoints_without_the_flag(trained, tmp_path):
    dump = copy_run(trained, tmp_path)
    for step in (1, 2):
        flip(dump / "checkpoints" / store.step_name(step) / "__0_0.distcp")
    before = listing(dump)
    result = run(dump, "--training.steps", "2", expect=2)
    err = one_error_line(result)
    assert "none can be resumed" in err and "--checkpoint.allow_fresh_start true" in err
    assert {k: v for k, v in listing(dump).items() if k != "exit_status"} == {
        k: v for k, v in before.items() if k != "exit_status"}  # nothing written, nothing replaced
    damaged = (dump / "checkpoints" / "step-000002" / "__0_0.distcp").read_bytes()
    old_metrics = (dump / "metrics.jsonl").read_text()
    result = run(dump, "--training.steps", "2", "--checkpoint.allow_fresh_start", "true")
    kept = sorted(p.name.split(".")[1].split("-")[0] for p in (dump / "checkpoints").glob("step-00000?.rejected-*"))
    assert kept == ["rejected", "rejected"], sorted(p.name for p in (dump / "checkpoints").iterdir())
    assert (next((dump / "checkpoints").glob("step-000002.rejected-*")) / "__0_0.distcp").read_bytes() == damaged
    assert next(dump.glob("metrics.jsonl.replaced-*")).read_text() == old_metrics
    assert [row["step"] for row in map(json.loads, (dump / "metrics.jsonl").read_text().splitlines())] == [1, 2]


# ---- 7. the model arguments are recorded: resume refuses others, export uses them ---------------


def test_resume_with_other_model_arguments_is_refused_naming_them(trained, tmp_path, capsys):
    dump = copy_run(trained, tmp_path)
    meta = store.read_marker(dump / "checkpoints" / "step-000002")
    assert meta["model_args"]["n_layers"] == 2 and meta["model_args"]["rope_theta"] == 12345
    before = listing(dump)
    result = run(dump, "--training.steps", "3", "--model.rope_theta", "500000", "--model.norm_eps", "1e-6", expect=2)
    err = one_error_line(result)
    assert "other model arguments" in err and "norm_eps 1e-05 (now 1e-06)" in err and "rope_theta 12345" in err
    assert "--model.rope_theta 12345" in err
    # Another flavor (issue 40 fault probe 16): the advice names the checkpoint's flavor first and
    # then only what differs from that flavor.
    import dataclasses

    from plait.models import get_model_spec

    marker = dump / "checkpoints" / "step-000002" / store.MARKER
    original = marker.read_text()
    body = json.loads(original)
    body["flavor"] = "1B"
    body["model_args"] = {**dataclasses.asdict(get_model_spec("llama3").flavors["1B"]), "n_layers": 2}
    marker.write_text(json.dumps(body))
    advice = one_error_line(run(dump, "--training.steps", "3", expect=2))
    assert "resume with the checkpoint's (--model.flavor 1B --model.n_layers 2)" in advice, advice
    marker.write_text(original)
    assert {k: v for k, v in listing(dump).items() if k != "exit_status"} == {
        k: v for k, v in before.items() if k != "exit_status"}
    # A checkpoint from before the record: the export's error says what is missing, truthfully.
    marker = dump / "checkpoints" / "step-000002" / store.MARKER
    body = json.loads(marker.read_text())
    del body["model_args"]
    marker.write_text(json.dumps(body))
    code = hf_export.main(["--checkpoint", str(marker.parent), "--output", str(tmp_path / "hf")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0 and "records no model arguments" in err and "layers.2" in err, err
    assert not (tmp_path / "hf").exists()


# ---- 10. a save that cannot be written is one line; the last good checkpoint stays -------------


class _Loader:
    def state_dict(self):
        return {"position": 0}

    def load_state_dict(self, state):
        pass


def manager(dump: Path, *overrides: str, rank: int = 0, world_size: int = 1):
    """A CheckpointManager of a tiny model in this process (no process group)."""
    import dataclasses
    from types import SimpleNamespace

    import torch

    from plait.models import get_model_spec
    from plait.trainer.checkpoint import CheckpointManager
    from plait.trainer.config import build_config

    pairs = [("job.dump_folder", str(dump)), ("checkpoint.enable", "true"), ("checkpoint.interval", "1"), *zip(overrides[::2], overrides[1::2])]
    config = build_config({}, pairs)
    spec = get_model_spec("llama3")
    model = spec.model_cls(dataclasses.replace(spec.flavors["debugmodel"], n_layers=1, dim=64, n_heads=4, n_kv_heads=4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    dims = SimpleNamespace(world_size=world_size, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1, etp=1)
    return CheckpointManager(config, dims, model, optimizer, scheduler, _Loader(), rank=rank)


@pytest.mark.parametrize("where", ["under_a_file", "dcp", "rng", "marker", "async"])
def test_a_failed_save_is_one_line_naming_the_folder_and_keeps_the_last_good_one(tmp_path, monkeypatch, where):
    import errno

    import torch.distributed.checkpoint as dcp

    from plait.checkpoint import state
    from plait.trainer import exit_codes
    from plait.trainer.failures import exit_code_of

    mgr = manager(tmp_path, *(["checkpoint.async_mode", "async"] if where == "async" else []))
    mgr.load()
    mgr.after_step(1)
    mgr.writer.wait()
    good = tmp_path / "checkpoints" / "step-000001"
    assert store.verify_checksums(good, store.check(good)) is None

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    folder = tmp_path / "checkpoints"
    if where == "under_a_file":  # a real failure, no patching (root ignores chmod): the folder became a file
        (tmp_path / "a_file").write_text("")
        folder = mgr.folder = mgr.writer.folder = tmp_path / "a_file" / "checkpoints"
    elif where == "dcp":
        monkeypatch.setattr(dcp, "save", full)
    elif where == "rng":
        monkeypatch.setattr(state, "save_rng", lambda *a: (_ for _ in ()).throw(RuntimeError(
            "[enforce fail at inline_container.cc:664] . unexpected pos 704 vs 598")))
    elif where == "marker":
        monkeypatch.setattr(store, "write_marker", full)
    else:  # the background write fails: what DCP's future raises
        from torch.distributed.checkpoint.filesystem import FileSystemWriter

        monkeypatch.setattr(FileSystemWriter, "write_data", full)
    with pytest.raises(store.CheckpointWriteError) as info:
        mgr.after_step(2)
        mgr.after_step(3, last=True)  # async: the failure surfaces when the save is waited for
    message = str(info.value)
    assert "\n" not in message and str(folder) in message and f"{good} (step 1)" in message
    cause = {"rng": "unexpected pos 704 vs 598", "under_a_file": "Not a directory"}.get(where, "No space left on device")
    assert cause in message, message
    assert exit_code_of(info.value) == exit_codes.INFRA
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]  # no half save left
    assert store.verify_checksums(good, store.check(good)) is None


# ---- 11. one run per checkpoint folder too; a stale lock is taken by exactly one run -------------


def _race_for_the_lock(folder: str, start, done, wins) -> None:
    import threading
    import time

    from plait.trainer.config import ConfigError
    from plait.trainer.run_lock import RunLock

    # Judging the holder takes a while (a slow /proc or network filesystem): the window in which
    # the old code let a second racer delete the first one's fresh lock and take it too.
    judge = RunLock._stale
    RunLock._stale = lambda self, holder: (time.sleep(0.05), judge(self, holder))[1]
    lock = RunLock(folder)
    start.wait(timeout=60)
    try:
        lock.acquire()
        wins.put(os.getpid())
    except ConfigError:
        pass
    except Exception as e:  # the old code's double winners also collided writing exit_status
        wins.put(f"{type(e).__name__}: {e}")
    try:
        done.wait(timeout=60)  # a winner stays alive until every racer has tried
    except threading.BrokenBarrierError:
        pass


def test_a_stale_lock_is_taken_by_exactly_one_of_many_racing_processes(tmp_path):
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    racers = 12
    for round in range(4):
        folder = tmp_path / f"round{round}"
        folder.mkdir()
        (folder / ".plait-run.lock").write_text(json.dumps({"pid": dead.pid, "host": os.uname().nodename}))
        start, done, wins = ctx.Barrier(racers), ctx.Barrier(racers), ctx.Queue()
        procs = [ctx.Process(target=_race_for_the_lock, args=(str(folder), start, done, wins)) for _ in range(racers)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(60)
        winners = []
        while not wins.empty():
            winners.append(wins.get())
        assert len(winners) == 1, f"round {round}: {len(winners)} runs took the same stale lock"
        assert json.loads((folder / ".plait-run.lock").read_text())["pid"] == winners[0]


def _second_run_takes_its_locks(config, errors) -> None:
    from plait.trainer.config import ConfigError
    from plait.trainer.run_lock import take_run_locks

    try:
        take_run_locks(config, rank=0).release(0)
        errors.put("")
    except ConfigError as e:
        errors.put(str(e))


def test_two_runs_with_one_checkpoint_folder_cannot_both_run(tmp_path):
    import multiprocessing

    from plait.trainer.config import build_config
    from plait.trainer.run_lock import take_run_locks

    shared = tmp_path / "shared-checkpoints"

    def config(dump):
        return build_config({}, [("job.dump_folder", str(tmp_path / dump)), ("checkpoint.enable", "true"),
                                 ("checkpoint.folder", str(shared))])

    def second_run() -> str:  # another process (forked: no second torch import), as rank 0 of run b
        ctx = multiprocessing.get_context("fork")
        errors = ctx.Queue()
        proc = ctx.Process(target=_second_run_takes_its_locks, args=(config("b"), errors))
        proc.start()
        proc.join(60)
        return errors.get(timeout=5)

    first = take_run_locks(config("a"), rank=0)
    assert json.loads((shared / ".plait-checkpoint.lock").read_text())["dump_folder"] == str(tmp_path / "a")
    error = second_run()
    assert error.startswith("checkpoint.folder = ") and "is in use by another run" in error, error
    assert f"dump folder {tmp_path / 'a'}, since" in error
    assert (tmp_path / "b" / "exit_status").read_text() == "2\n"  # its dump folder's lock was given back
    assert not (tmp_path / "b" / ".plait-run.lock").exists()
    first.release(0)
    assert second_run() == ""  # free again
    assert not (shared / ".plait-checkpoint.lock").exists() and (tmp_path / "b" / "exit_status").read_text() == "0\n"
    assert not (shared / "exit_status").exists()


# ---- 12. a stop names the checkpoint a resume will use ---------------------------------------------


def test_the_stop_message_names_the_checkpoint_a_resume_uses(trained, tmp_path):
    from plait.trainer.config import build_config
    from plait.trainer.launch import stopped_message

    dump = copy_run(trained, tmp_path)
    # The stop's own save was SIGKILLed past job.stop_grace_s: its temporary folder is all there is.
    (dump / "checkpoints" / "step-000003.tmp-deadbeef").mkdir()
    flip(dump / "checkpoints" / "step-000002" / ".metadata")  # and the newest is damaged on top
    (dump / "checkpoints" / "step-000002" / ".metadata").write_bytes(b"x")

    def message(*overrides):
        pairs = [("job.dump_folder", str(dump)), *zip(overrides[::2], overrides[1::2])]
        return stopped_message(build_config({}, pairs))

    text = message("checkpoint.enable", "true")
    assert f"resumes from {dump / 'checkpoints' / 'step-000001'} (step 1)" in text, text
    assert "step 1." in message("checkpoint.enable", "false") and "checkpoint.enable is false" in message()
    assert "no complete checkpoint" in message("checkpoint.enable", "true", "checkpoint.folder", str(tmp_path / "none"))


# ---- 9. the launcher names the rank that failed first and how; codes a scheduler can act on ------


def test_failure_summary_names_the_first_rank_and_maps_signals_to_infrastructure():
    from plait.trainer.launch import failure_summary

    text, code = failure_summary({0: -15, 1: -9}, {0: 100, 1: 100}, 2)  # the case: rank 1 OOM-killed
    assert text.startswith("rank 1 of 2 failed first: it was killed by SIGKILL") and code == 74, text
    assert "then rank 0 was killed by SIGTERM" in text
    text, code = failure_summary({0: 74, 1: 3, 2: 75}, {0: 101, 1: 101, 2: 101}, 3)
    assert text.startswith("rank 1 of 3 failed first: it exited 3 (diverged)") and code == 3, text
    assert failure_summary({0: 2, 1: -9}, {0: 100, 1: 105}, 2)[1] == 2  # earlier wins over likelier


def test_a_rank_killed_by_sigkill_is_named_and_exits_74(tmp_path):
    import signal
    import time

    from plait.trainer.cli import EXIT_INFRA

    dump = tmp_path / "killed"
    proc = start_two_ranks(dump, *TINY, until="checkpoints/step-000001")
    try:
        deadline = time.monotonic() + 240
        ranks = {}
        while time.monotonic() < deadline and len(ranks) < 2:
            ranks = rank_pids(proc.pid)
            time.sleep(0.2)
        os.kill(ranks[1], signal.SIGKILL)  # what the OOM killer does
        _, err = proc.communicate(timeout=180)
    finally:
        proc.kill()
    last = err.strip().splitlines()[-1]
    assert proc.returncode == EXIT_INFRA, err[-3000:]
    assert last.startswith("plait-train: rank 1 of 2 failed first: it was killed by SIGKILL"), last
    assert (dump / "exit_status").read_text() == f"{EXIT_INFRA}\n"


def _one_rank_cannot_write(rank: int, world_size: int, dump: str, failing: str) -> str:
    """2 gloo ranks save step 1, then rank 1's part of step 2 fails: every rank must raise the same line."""
    import errno

    from plait.checkpoint import state

    mgr = manager(Path(dump), rank=rank, world_size=world_size)
    mgr.load()
    mgr.after_step(1)
    if rank == 1 and failing == "rng":
        def full(*args):
            raise OSError(errno.ENOSPC, "No space left on device")

        state.save_rng = full
    if rank == 0 and failing == "marker":
        def read_only(*args):
            raise OSError(errno.EROFS, "Read-only file system")

        store.write_marker = read_only
    try:
        mgr.after_step(2)
    except store.CheckpointWriteError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("failing", ["rng", "marker"])
def test_a_write_failing_on_one_rank_fails_every_rank_with_one_line(tmp_path, failing):
    from plait.testing import run_on_ranks

    messages = run_on_ranks(_one_rank_cannot_write, 2, str(tmp_path), failing, timeout=120)
    cause = "No space left on device" if failing == "rng" else "Read-only file system"
    assert messages[0] == messages[1] and cause in messages[0] and "step 2" in messages[0], messages
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]


def _background_write_fails_on_rank_1(rank: int, world_size: int, dump: str) -> tuple:
    """2 gloo ranks, async saves every 5 steps: rank 1's background write of step 5 fails a little
    later. Every rank must learn of it at the same step, with the same line (issue 40 item 5)."""
    import errno
    import time

    mgr = manager(Path(dump), "checkpoint.async_mode", "async", "checkpoint.interval", "5", rank=rank,
                  world_size=world_size)  # fmt: skip
    mgr.load()
    if rank == 1:  # DCP's own write goes on (its collectives need every rank); its result fails later
        from concurrent.futures import ThreadPoolExecutor

        import torch.distributed.checkpoint as dcp

        real_async_save, pool = dcp.async_save, ThreadPoolExecutor(1)

        def async_save_that_fails(*args, **kwargs):
            written = real_async_save(*args, **kwargs)

            def result():
                written.result()
                time.sleep(0.5)
                raise OSError(errno.ENOSPC, "No space left on device")

            return pool.submit(result)

        dcp.async_save = async_save_that_fails
    for step in range(1, 200):
        try:
            mgr.after_step(step)
        except store.CheckpointWriteError as e:
            return step, str(e)
        time.sleep(0.02)
    return None, "no error"


def test_a_background_save_failing_on_one_rank_is_seen_by_every_rank_at_the_same_step(tmp_path):
    from plait.testing import run_on_ranks

    (step0, line0), (step1, line1) = run_on_ranks(_background_write_fails_on_rank_1, 2, str(tmp_path), timeout=120)
    assert step0 == step1 and step0 is not None and step0 > 5, (step0, step1)
    assert line0 == line1 and "could not save step 5" in line0 and "rank 1" in line0 and "No space" in line0, line0
    assert not (tmp_path / "checkpoints" / "step-000005").exists()


def test_a_full_disk_during_the_hf_export_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    """issue 40 fault probe 6: a traceback, exit 1 and a .tmp folder left before."""
    import dataclasses
    import errno

    import torch

    import plait.models.hf.io as hf_io
    from plait.checkpoint import hf_sharded
    from plait.models import get_model_spec

    spec = get_model_spec("llama3")
    args = dataclasses.replace(spec.flavors["debugmodel"], n_layers=1, dim=64, n_heads=4, n_kv_heads=4)
    model = spec.model_cls(args)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hf_io, "save_file_like_open", full)
    with pytest.raises(store.CheckpointWriteError, match="could not write the Hugging Face export.*No space left"):
        hf_sharded.export_hf_sharded(model, tmp_path / "hf-step-2", "llama3", "debugmodel", torch.float32, args)
    assert list(tmp_path.iterdir()) == []
