"""Float8 on the device (training.float8): the CUDA branch runs torch._scaled_mm itself (on CPU the
matmuls are torchao's emulation, plait/trainer/float8.py), makes no synchronizing CUDA call, and
trains like bf16 over a few steps.

In the CPU dry run the same steps run through the emulation under the sentinel alone.
"""

import pytest
import torch
from test_gpu_step import DSV3, LLAMA, SyncWatch

from plait.testing.trainer import parity_args, train_in_process

pytest.importorskip("torchao")
FLOAT8 = ["--training.dtype", "bfloat16", "--training.float8_filter", "divisible"]


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_float8_step_runs_scaled_mm_without_a_host_sync(device, tmp_path, recipe, monkeypatch):
    """CUDA branch: plait/trainer/float8.py:convert_to_float8 (emulate only on CPU) -- a Llama step
    with float8 linears calls torch._scaled_mm on CUDA, makes no synchronizing call, and its losses
    stay within 2 % of bf16's over 3 steps."""
    calls = []
    scaled_mm = torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(1) or scaled_mm(*a, **k))
    watch = SyncWatch(device, "error")
    rows = train_in_process(tmp_path / recipe, *parity_args(steps=3), *LLAMA, *FLOAT8, "--training.float8", recipe,
                            sentinel=watch)  # fmt: skip
    assert watch.step_counts() == [(0, 0)] * 3, watch.report()
    if device.type == "cuda":
        assert watch.cuda_syncs == [0] * 3, watch.cuda_messages[:5]
        assert calls, "no torch._scaled_mm call: the float8 matmuls were emulated on CUDA"
    else:
        assert not calls  # the CPU emulation (dequantized fp32 matmuls)
    bf16 = train_in_process(tmp_path / "bf16", *parity_args(steps=3), *LLAMA, "--training.dtype", "bfloat16")
    for a, b in zip(rows, bf16, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.02, (a["loss"], b["loss"])


def test_float8_experts_run_scaled_grouped_mm_without_a_host_sync(device, tmp_path, monkeypatch):
    """CUDA branch: plait/trainer/float8_experts.py:ScaledGroupedMM (emulate only on CPU; auto picks
    rowwise on sm89 / sm90, MXFP8 on sm100) -- a DeepSeek-V3 step whose experts run the float8
    grouped GEMM calls torch._scaled_grouped_mm on sm89 / sm90 (torchao's rowwise kernel), makes no
    synchronizing call, and its losses stay within 2 % of bf16's over 3 steps."""
    calls = []
    scaled = torch._scaled_grouped_mm
    monkeypatch.setattr(torch, "_scaled_grouped_mm", lambda *a, **k: calls.append(1) or scaled(*a, **k))
    watch = SyncWatch(device, "error")
    args = [*parity_args(steps=3), *DSV3, "--training.dtype", "bfloat16"]
    rows = train_in_process(tmp_path / "f8", *args, "--training.float8_experts", "auto", sentinel=watch)
    assert watch.step_counts() == [(0, 0)] * 3, watch.report()
    if device.type == "cuda":
        assert watch.cuda_syncs == [0] * 3, watch.cuda_messages[:5]
        if torch.cuda.get_device_capability() < (10, 0):
            assert calls, "no torch._scaled_grouped_mm call: the experts' float8 GEMMs did not run on CUDA"
    else:
        assert not calls  # the CPU emulation (dequantized MXFP8 operands, a bf16 grouped GEMM)
    bf16 = train_in_process(tmp_path / "bf16", *args)
    for a, b in zip(rows, bf16, strict=True):
        assert abs(a["loss"] - b["loss"]) / b["loss"] < 0.02, (a["loss"], b["loss"])
