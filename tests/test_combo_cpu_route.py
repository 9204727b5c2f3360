"""One CPU-route switch (issue 40 item 2): plait.models.cpu_bf16 decides the kernels of bf16
products and attention, context parallel takes the answer (no probe of its own)."""

import pytest
import torch

from plait.contextparallel import kernels
from plait.models import cpu_bf16
from plait.trainer.config import build_config
from plait.trainer.validate import cp_config


@pytest.mark.parametrize("route, units, in_fp32", [
    ("auto", False, True), ("auto", True, False), ("native", False, False), ("fp32", True, True),
])  # fmt: skip
def test_context_parallel_takes_the_models_route(route, units, in_fp32, monkeypatch):
    import plait.contextparallel as cp

    monkeypatch.setattr(cpu_bf16, "CPU_BF16_UNITS", units)
    monkeypatch.setattr(cpu_bf16, "ROUTE", "auto")
    config = build_config({}, [("training.cpu_bf16", route)])
    cpu_bf16.set_route(config.training.cpu_bf16)
    info = {"attention_heads": {"n_heads": 8, "n_kv_heads": 4, "head_dim": 32}}
    assert cp_config(cp, config, info).cpu_half_in_fp32 is in_fp32
    monkeypatch.setattr(kernels, "CPU_HALF_IN_FP32", False)
    model = torch.nn.Module()
    model.sdpa = torch.nn.Module()
    cp.apply_context_parallel(model, _OneRankMesh(), ["sdpa"], cp_config(cp, config, info))
    assert kernels.CPU_HALF_IN_FP32 is in_fp32


class _OneRankMesh:
    """What apply_context_parallel reads of a mesh (its size); no process group is started here."""

    def size(self) -> int:
        return 1
