"""The metrics' per-step device time on CUDA (plait.trainer.metrics `device_step_s`): one CUDA event
after each step's work, read at the flush's copy without a sync of its own.

What a lease's table puts beside the wall clock ("step ms, CUDA events"), so it is checked here:
the events are complete when the flush reads them (no "device not ready" error) and add no host
sync, each step of a window gets its own time, and a one-step window's device time lies inside its
sync-to-sync wall time (its start event is recorded after the window's clock starts, its end event
completes before the flush's copy returns). On the CPU dry run the rows carry no `device_step_s`.
"""

import torch
from gpu_helpers import CudaSyncs

import plait.trainer.metrics as metrics


def _logger(tmp_path, device):
    return metrics.MetricsLogger(
        dump_folder=str(tmp_path), rank=0, world_size=1, device=device, loss_mesh=None,
        tokens_per_step_per_rank=128, flops_per_token=1e6, peak_tflops_per_rank=1.0, tensorboard=False,
        total_steps=6, progress_bar=False,
    )  # fmt: skip


def _step(x: torch.Tensor, matmuls: int) -> torch.Tensor:
    for _ in range(matmuls):
        x = torch.tanh(x @ x)
    return x.float().mean()


def _flush_syncs(logger, x, device) -> tuple[list[dict], int]:
    """One window of three steps (the second ten times the work), flushed: its rows and the host
    syncs CUDA counted in the flush."""
    norm = torch.tensor(0.5, device=device)
    for step, matmuls in ((1, 2), (2, 20), (3, 2)):
        logger.record(step, _step(x, matmuls), norm, 1e-3, 0.0)
    with CudaSyncs(device, "warn") as syncs:
        rows = logger.flush()
    return rows, syncs.count


def test_device_step_time_per_step(tmp_path, device, monkeypatch):
    x = torch.randn(1024, 1024, device=device)
    _step(x, 2).item()  # cuBLAS and the kernels loaded before any step is timed
    logger = _logger(tmp_path / "events", device)
    rows, syncs = _flush_syncs(logger, x, device)
    for step in (4, 5):  # one-step windows: the lease's log_freq 1
        logger.record(step, _step(x, 10), torch.tensor(0.5, device=device), 1e-3, 0.0)
        rows += logger.flush()
    logger.close()
    if device.type != "cuda":
        assert all("device_step_s" not in r for r in rows)
        return
    monkeypatch.setattr(metrics, "_device_event", lambda device: None)
    without, syncs_without = _flush_syncs(_logger(tmp_path / "plain", device), x, device)
    assert syncs == syncs_without and all("device_step_s" not in r for r in without)  # the events add no sync
    device_s = [r["device_step_s"] for r in rows]
    assert all(s > 0 for s in device_s), device_s
    assert device_s[1] > device_s[0] and device_s[1] > device_s[2], device_s  # 20 matmuls against 2
    for r in rows[3:]:
        assert r["device_step_s"] <= r["step_time_s"], r
