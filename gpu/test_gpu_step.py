"""Whole training steps on the device under the step sentinel and CUDA's own sync detector.

`torch.cuda.set_sync_debug_mode` makes CUDA report every synchronizing call the step makes; the
sentinel (plait.testing.sentinel) predicts them on CPU runs. Here both watch the same steps of the
real trainer (in-process): dense Llama and DeepSeek-V3 (capacity and dropless) must make no sync
but the counted one per MoE layer and micro-batch of the dropless expert-parallel dispatch, and
the sentinel's count must equal CUDA's. Plus compile per block (training.compile) against eager.

In the CPU dry run the same steps run under the sentinel alone (gloo for the 2-rank run).
"""

import multiprocessing
import os
import socket
from pathlib import Path

import pytest
import torch
from gpu_helpers import CudaSyncs

from plait.testing.sentinel import StepSentinel
from plait.testing.trainer import parity_args, train_in_process

LLAMA = ["--config", "llama3_debugmodel", "--model.n_layers", "2", "--training.local_batch_size", "2"]
# 3 layers: 1 dense + 2 MoE (the debug flavor's first layer is dense).
DSV3 = ["--config", "deepseek_v3_debugmodel", "--model.n_layers", "3", "--training.local_batch_size", "2"]
# Qwen3-MoE (issue 52): 2 blocks, both MoE (softmax top-2 of 8, no shared expert), q/k head norms.
QWEN3_MOE = ["--config", "qwen3_debugmodel", "--model.flavor", "debugmodel_moe", "--model.n_layers", "2",
             "--training.local_batch_size", "2"]  # fmt: skip
MOE_LAYERS = 2


class SyncWatch(StepSentinel):
    """The sentinel plus, on CUDA, CUDA's own detector (gpu_helpers.CudaSyncs) around each step:
    "error" raises at the first synchronizing call, "warn" counts them into `cuda_syncs`."""

    def __init__(self, device: torch.device, mode: str):
        super().__init__(device)
        self.cuda = CudaSyncs(device, mode)

    @property
    def cuda_syncs(self) -> list[int]:
        return self.cuda.syncs

    @property
    def cuda_messages(self) -> list[str]:
        return self.cuda.messages

    def __enter__(self):
        super().__enter__()
        self.cuda.__enter__()
        return self

    def __exit__(self, *exc):
        self.cuda.__exit__(*exc)
        super().__exit__(*exc)


def _run(dump: Path, device: torch.device, mode: str, *args: str) -> tuple[SyncWatch, list[dict]]:
    watch = SyncWatch(device, mode)
    rows = train_in_process(dump, *parity_args(steps=3), *args, sentinel=watch)
    return watch, rows


def _bf16(device: torch.device) -> list[str]:
    # bf16 on CUDA: the dtype the fast grouped_mm and flash kernels take (fp32 grouped_mm falls back
    # to a path that syncs); the CPU dry run stays fp32.
    return ["--training.dtype", "bfloat16"] if device.type == "cuda" else []


def test_dense_llama_step_makes_no_host_sync(device, tmp_path):
    """CUDA branch: plait/trainer/train.py:Trainer.train_step -- a dense Llama step (flash SDPA,
    fused AdamW, clipping) makes no synchronizing CUDA call and breaks no kernel precondition."""
    watch, rows = _run(tmp_path, device, "error", *LLAMA, *_bf16(device))
    assert watch.step_counts() == [(0, 0)] * 3, watch.report()
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(0, 0)] * 3
    if device.type == "cuda":
        assert watch.cuda_syncs == [0] * 3


def test_document_masked_llama_step_makes_no_host_sync(device, tmp_path):
    """CUDA branch: plait::document_attention's varlen route in the trainer's step (the trainer reads
    each row's segments and builds the offsets on the host before the copy, to_device_with_segments)
    -- a document-masked Llama step (one FA2 varlen call per layer, rows of several documents at seq
    512) makes no synchronizing CUDA call."""
    args = [*LLAMA, *_bf16(device), "--model.attention_mask", "document", "--training.seq_len", "512"]
    watch, rows = _run(tmp_path, device, "error", *args)
    assert watch.step_counts() == [(0, 0)] * 3, watch.report()
    if device.type == "cuda":
        assert watch.cuda_syncs == [0] * 3, watch.cuda_messages[:5]


@pytest.mark.parametrize("model", [DSV3, QWEN3_MOE], ids=["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("capacity", ["0", "2.0"], ids=["dropless", "capacity"])
def test_moe_step_at_one_rank_makes_no_host_sync(device, tmp_path, capacity, model):
    """CUDA branch: plait/models/moe (grouped_mm experts, permute indices) at ep 1 -- no sync in
    either expert_capacity_factor setting (the counted sync belongs to the ep > 1 dispatch), for
    DeepSeek-V3's blocks and Qwen3-MoE's."""
    args = [*model, *_bf16(device), "--parallelism.expert_capacity_factor", capacity]
    watch, rows = _run(tmp_path, device, "error", *args)
    assert watch.step_counts() == [(0, 0)] * 3, watch.report()
    if device.type == "cuda":
        assert watch.cuda_syncs == [0] * 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ep_rank(rank: int, world: int, port: int, dump: str, device_type: str, capacity: str, results) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )  # fmt: skip
    import torch.distributed as dist

    try:
        device = torch.device(device_type)
        mode = "warn" if capacity == "0" else "error"
        args = [*DSV3, *_bf16(device), "--parallelism.ep", "2", "--parallelism.expert_capacity_factor", capacity,
                "--training.gradient_accumulation_steps", "2"]  # fmt: skip
        watch, rows = _run(Path(dump), device, mode, *args)
        results.put((rank, (watch.step_counts(), watch.cuda_syncs, watch.report(), watch.cuda_messages[:5])))
    except BaseException as e:
        results.put((rank, repr(e)))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("capacity", ["0", "2.0"], ids=["dropless", "capacity"])
def test_ep2_step_syncs_exactly_the_counted_times(device, n_gpus, tmp_path, capacity):
    """CUDA branch: plait/expertparallel/dispatch.py:dispatch (NCCL uneven all-to-all, the split
    sizes' one copy to the host) -- dropless syncs exactly once per MoE layer and micro-batch (CUDA's
    count equals the sentinel's), capacity mode never."""
    if device.type == "cuda" and n_gpus < 2:
        pytest.skip("needs 2 GPUs (one NCCL communicator cannot hold two ranks on one GPU)")
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=_ep_rank, args=(r, 2, port, str(tmp_path), device.type, capacity, results)) for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        got = dict(results.get(timeout=400) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    expected = MOE_LAYERS * 2 if capacity == "0" else 0  # 2 micro-batches
    for rank in range(2):
        assert not isinstance(got[rank], str), f"rank {rank}: {got[rank]}"
        counts, cuda_syncs, report, messages = got[rank]
        assert counts == [(expected, 0)] * 3, report
        if device.type == "cuda":
            assert cuda_syncs == [expected] * 3, messages


@pytest.mark.cuda_only
def test_compiled_blocks_match_eager(device, tmp_path):
    """CUDA branch: plait/trainer/parallelize.py:parallelize (training.compile: each block compiled
    with inductor / Triton) -- the same losses as eager within fp32 kernel-fusion tolerance, and no
    host sync in the compiled steps after the first (which compiles)."""
    eager = train_in_process(tmp_path / "eager", *parity_args(steps=3), *LLAMA)
    watch = CudaSyncs(device)
    compiled = train_in_process(
        tmp_path / "compiled", *parity_args(steps=3), *LLAMA, "--training.compile", "true", sentinel=watch
    )
    for a, b in zip(eager, compiled, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-4 * abs(a["loss"]), (a["loss"], b["loss"])
    assert watch.syncs[1:] == [0, 0], watch.messages[:5]


@pytest.mark.cuda_only
@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_cuda_graph_blocks_match_eager(device, tmp_path, model):
    """CUDA branch: plait/trainer/parallelize.py (training.compile_mode = reduce-overhead: each
    compiled block replayed as a CUDA graph) -- the losses of eager within bf16 fusion tolerance,
    and no host sync once the graphs are recorded (steps 1-2 record; the MoE at one rank is the
    sync-free grouped_mm path, docs/cuda_graphs.md)."""
    args = [*(LLAMA if model == "llama" else DSV3), *_bf16(device)]
    eager = train_in_process(tmp_path / "eager", *parity_args(steps=4), *args)
    watch = CudaSyncs(device)
    graphed = train_in_process(
        tmp_path / "graphed", *parity_args(steps=4), *args,
        "--training.compile", "true", "--training.compile_mode", "reduce-overhead", sentinel=watch,
    )  # fmt: skip
    for a, b in zip(eager, graphed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 2e-2 * abs(a["loss"]), (a["loss"], b["loss"])
    assert watch.syncs[2:] == [0, 0], watch.messages[:5]
