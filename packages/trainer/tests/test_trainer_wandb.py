"""metrics.wandb: a real (offline) Weights & Biases run gets the rows metrics.jsonl gets, with the
run's configuration as its config; without wandb installed the setting fails validation in one line."""

import json
import struct
import sys
import time

import pytest
import torch

from plait.testing.trainer import train_in_process
from plait.trainer.cli import main
from plait.trainer.config import ConfigError, build_config
from plait.trainer.metrics import MetricsLogger


def _wandb_records(path):
    """The records of an offline run's .wandb file (a LevelDB-style log of wandb's protobuf
    Records, which wandb no longer reads from Python): 7-byte file header, then 32 KiB blocks of
    chunks, each a 7-byte header (crc32, length, kind: 1 full, 2 first, 3 middle, 4 last)."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    pos, parts, block = 7, [], 32768
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0 or pos + 7 + length > len(data):  # the end, or a chunk not written yet
            break
        parts.append(data[pos + 7 : pos + 7 + length])
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _finished_run_records(run_folder, timeout_s: float = 60.0) -> list:
    """The records of the offline run in `run_folder` once they end with the run's exit: wandb's
    service process writes the file and may flush it a moment after finish() has returned."""
    deadline = time.monotonic() + timeout_s
    while True:
        files = list(run_folder.glob("*.wandb"))
        records = list(_wandb_records(files[0])) if len(files) == 1 else []
        if any(r.WhichOneof("record_type") == "exit" for r in records) or time.monotonic() > deadline:
            return records
        time.sleep(0.05)


def _name(item) -> str:
    return item.key or "/".join(item.nested_key)  # wandb writes one or the other, by version


def test_wandb_offline_run_logs_the_metrics_rows(tmp_path, monkeypatch):
    pytest.importorskip("wandb")  # in the test extra; skipped only where someone installed without it
    wandb_dir = tmp_path / "wandb_dir"
    wandb_dir.mkdir()
    for name in ("WANDB_PROJECT", "WANDB_ENTITY", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    dump = tmp_path / "run"
    # fmt: off
    rows = train_in_process(
        dump,
        "--training.steps", "4", "--training.seq_len", "32", "--training.local_batch_size", "2",
        "--metrics.log_freq", "3", "--metrics.cpu_peak_tflops", "0.1", "--metrics.progress_bar", "false",
        # Validation at step 2 reaches wandb before the rows of steps 1-3 (flushed at 3): out of order.
        "--data.val_dataset", "builtin", "--data.val_interval", "2", "--data.val_steps", "1",
        "--metrics.wandb", "true", "--metrics.wandb_project", "plait-test", "--metrics.wandb_run_name", "tiny",
    )
    # fmt: on
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert not (dump / "wandb").exists()  # WANDB_DIR wins over the dump folder
    runs = list((wandb_dir / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, runs

    run, history, exit_code = None, [], None
    for record in _finished_run_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            history.append({_name(item): json.loads(item.value_json) for item in record.history.item})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    assert (run.project, run.display_name) == ("plait-test", "tiny")
    config = {_name(item): json.loads(item.value_json) for item in run.config.update}
    assert config["training"]["steps"] == 4 and config["metrics"]["wandb"] is True
    assert config["model"]["name"] == "llama3" and config["job"]["dump_folder"] == str(dump)
    assert exit_code == 0

    train = {h["step"]: h for h in history if "loss" in h}
    assert sorted(train) == [1, 2, 3, 4]  # none dropped though step 2's val_loss came first
    assert {s: h["loss"] for s, h in train.items()} == {r["step"]: r["loss"] for r in rows}
    for key in ("grad_norm", "lr", "tokens_per_second", "mfu", "memory_gib", "data_time_s"):
        assert [train[r["step"]][key] for r in rows] == [r[key] for r in rows], key
    val = [(h["step"], h["val_loss"]) for h in history if "val_loss" in h]
    assert [s for s, _ in val] == [2, 4] and all(v > 0 for _, v in val)


def test_wandb_not_installed_fails_validation_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    code = main(["--job.dump_folder", str(tmp_path), "--training.steps", "1", "--metrics.wandb", "true"])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert "metrics.wandb = true needs wandb" in err
    assert "pip install 'plait-trainer[wandb]'" in err and "metrics.wandb = false" in err
    assert not (tmp_path / "metrics.jsonl").exists()  # failed before training began


def _logger(dump, wandb_config):
    return MetricsLogger(
        dump_folder=str(dump), rank=0, world_size=1, device=torch.device("cpu"), loss_mesh=None,
        tokens_per_step_per_rank=128, flops_per_token=1e6, peak_tflops_per_rank=1.0, tensorboard=False,
        total_steps=2, progress_bar=False, wandb_config=wandb_config,
    )  # fmt: skip


def test_wandb_run_of_a_failed_training_is_marked_failed(tmp_path, monkeypatch):
    """close() from the `finally` an error passes through finishes the W&B run with exit code 1;
    per-layer lists arrive as one curve each (as in TensorBoard); without WANDB_DIR the run's files
    go under the dump folder."""
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_DIR", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = _logger(tmp_path, build_config({"metrics": {"wandb": True}}))
    with pytest.raises(RuntimeError, match="step 2 failed"):
        try:
            logger.record(1, torch.tensor(2.5), torch.tensor(0.5), 1e-3, 0.0, {"moe_imbalance": torch.tensor([1.5, 1.25])})
            logger.flush()
            raise RuntimeError("step 2 failed")
        finally:
            logger.close()
    (run_folder,) = (tmp_path / "wandb").glob("offline-run-*")
    records = _finished_run_records(run_folder)
    (exit_record,) = [r.exit for r in records if r.WhichOneof("record_type") == "exit"]
    assert exit_record.exit_code == 1
    (row,) = [{_name(i): json.loads(i.value_json) for i in r.history.item} for r in records if r.history.item]
    assert (row["step"], row["loss"], row["moe_imbalance/0"], row["moe_imbalance/1"]) == (1, 2.5, 1.5, 1.25)


def test_wandb_init_failure_is_one_line(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")

    def init(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", init)
    with pytest.raises(ConfigError, match=r"wandb.init failed \(api_key not configured.*WANDB_MODE=offline") as e:
        _logger(tmp_path, build_config({"metrics": {"wandb": True}}))
    assert "\n" not in str(e.value)
