"""MetricsLogger: per-step extra values (the MoE metrics) reach metrics.jsonl and tensorboard,
with one device-to-host copy per flush whatever their number."""

import json
import time

import torch

from plait.trainer.metrics import MetricsLogger


def _logger(tmp_path, tensorboard=True):
    return MetricsLogger(
        dump_folder=str(tmp_path), rank=0, world_size=1, device=torch.device("cpu"), loss_mesh=None,
        tokens_per_step_per_rank=128, flops_per_token=1e6, peak_tflops_per_rank=1.0, tensorboard=tensorboard,
        total_steps=2, progress_bar=False,
    )


def test_extra_step_values_are_written_per_step(tmp_path, capsys):
    logger = _logger(tmp_path)
    for step, imbalance in ((1, [1.5, 1.25]), (2, [1.0, 2.0])):
        extra = {"moe_imbalance": torch.tensor(imbalance), "moe_host_syncs": 2, "moe_dropped": torch.tensor(step),
                 "moe_ep_imbalance": torch.tensor(imbalance) / 2 + 0.5}  # fmt: skip
        logger.record(step, torch.tensor(3.0 - step), torch.tensor(0.5), 1e-3, 0.0, extra)
    rows = logger.flush()
    logger.close()
    assert [r["moe_imbalance"] for r in rows] == [[1.5, 1.25], [1.0, 2.0]]
    assert [r["moe_host_syncs"] for r in rows] == [2, 2]
    assert [r["moe_dropped"] for r in rows] == [1, 2] and isinstance(rows[0]["moe_dropped"], int)
    written = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["moe_imbalance"] for r in written] == [[1.5, 1.25], [1.0, 2.0]]
    assert [r["moe_ep_imbalance"] for r in rows] == [[1.25, 1.125], [1.0, 1.5]]
    assert "moe max/mean 2.00 (ep rank 1.50)" in capsys.readouterr().out

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"moe_imbalance/0", "moe_imbalance/1", "moe_host_syncs", "moe_dropped", "loss"} <= tags
    assert [e.value for e in events.Scalars("moe_imbalance/1")] == [1.25, 2.0]


def test_step_time_includes_waiting_for_the_device(tmp_path):
    """On a GPU a step that never blocks the host returns once its kernels are queued; the flush's
    device-to-host copy is where the host waits for them. The window's time must be read after that
    wait (read before it, an H100 run reported 465 % MFU). Here the wait is a slow `_to_host`."""
    wait_s = 0.3

    class SlowDevice(MetricsLogger):
        def _to_host(self, w):
            time.sleep(wait_s)  # the queued kernels finishing
            return super()._to_host(w)

    logger = SlowDevice(
        dump_folder=str(tmp_path), rank=0, world_size=1, device=torch.device("cpu"), loss_mesh=None,
        tokens_per_step_per_rank=128, flops_per_token=1e6, peak_tflops_per_rank=1.0, tensorboard=False,
        total_steps=2, progress_bar=False,
    )  # fmt: skip
    for step in (1, 2):
        logger.record(step, torch.tensor(1.0), torch.tensor(0.5), 1e-3, 0.0)
    rows = logger.flush()
    logger.close()
    assert all(r["step_time_s"] >= wait_s / 2 for r in rows), [r["step_time_s"] for r in rows]
    assert rows[0]["tokens_per_second"] <= 128 / (wait_s / 2)


def test_ep_rank_imbalance_sums_each_ranks_experts():
    from plait.trainer.moe_step import ep_rank_rows, max_over_mean

    # 2 layers x 4 experts on 2 EP ranks: rank 0 holds experts 0-1, rank 1 experts 2-3.
    counts_LE = torch.tensor([[10.0, 30.0, 20.0, 20.0], [0.0, 0.0, 40.0, 40.0]])
    rows_LR = ep_rank_rows(counts_LE, 2)
    assert rows_LR.tolist() == [[40.0, 40.0], [0.0, 80.0]]
    # Layer 0: experts uneven (30 / 20 = 1.5) but the ranks equal; layer 1: all on one rank.
    assert max_over_mean(rows_LR).tolist() == [1.0, 2.0]
    assert max_over_mean(counts_LE).tolist() == [1.5, 2.0]


def test_a_dump_folder_deleted_mid_run_is_one_line(tmp_path):
    """TensorBoard's writer into a deleted folder: an InfrastructureFault naming the folder (exit 74,
    one line), not its traceback; close() after it does not raise (issue 40 fault probe 13)."""
    import shutil

    import pytest

    from plait.trainer.exit_codes import InfrastructureFault

    dump = tmp_path / "run"
    logger = _logger(dump)
    logger.record(1, torch.tensor(2.0), torch.tensor(0.5), 1e-3, 0.0)
    logger.flush()
    shutil.rmtree(dump)
    logger.record(2, torch.tensor(1.0), torch.tensor(0.5), 1e-3, 0.0)
    with pytest.raises(InfrastructureFault, match=f"cannot write under {dump}.*deleted"):
        logger.flush()
        logger.log_scalars(2, {"val_loss": 1.0})
    logger.close()
