"""Float8 on the device (training.float8): the CUDA branch runs torch._scaled_mm itself (on CPU the
matmuls are torchao's emulation, plait/trainer/float8.py), makes no synchronizing CUDA call, and
trains like bf16 over a few steps.

In the CPU dry run the same steps run through the emulation under the sentinel alone.
"""

import pytest
import torch
from test_gpu_step import LLAMA, SyncWatch

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
