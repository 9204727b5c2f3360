"""Run torchtitan's training entry point on CPU: `python torchtitan_cpu.py <torchtitan args>`.

Meant to run inside the benchmark's torchtitan venv (see common.py), as a
single process (WORLD_SIZE=1) or under torchrun (gloo; bench_expert_parallel.py). torchtitan
0.3.0 assumes an accelerator; these runtime patches touch torchtitan (and which device torch
reports to it) only, never plait:

  * report "cpu" as the available device type, so torchtitan picks `torch.cpu` as its device
    module and builds the model on CPU (its process group then uses gloo);
  * give torchtitan a CPU "device module" with the calls it makes on torch.cuda (set_device,
    device name and properties, memory stats: peak RSS stands in for device memory);
  * import torchtitan's MinimalAsyncEP Triton kernels (imported at module level by every MoE
    model) under a stub `triton`, removed again right after: triton is not installed on this
    CPU machine and those kernels never run (the all-to-all dispatcher is used);
  * causal scaled-dot-product attention instead of FlexAttention, whose backward does not run on
    CPU (the same attention plait's model computes), for Llama 3 and for DeepSeek-V3's MLA;
  * skip the process-group timeout change after step 1 (torch.distributed.set_timeout is not in
    torch 2.13; a single process has no collective to time out);
  * FSDP modules reduce gradients with plain SUM (`set_force_sum_reduction_for_comms`): torchtitan
    sets FSDP's divide factor to 1.0, which selects ReduceOp.PREMUL_SUM, NCCL-only (gloo raises);
    SUM then x 1.0 gives the same gradients;
  * optional (PLAIT_BENCH_COUNT_TT_SYNCS=1): count the EP dispatcher's device-to-host transfers
    of the split sizes (`AllToAllTokenDispatcher._sync_token_count_exchange`), printed at exit;
  * optional (PLAIT_BENCH_COUNT_OPS=PATH): count the ops one `Trainer.train_step` dispatches with
    plait's counter (bench_host_ops.py), written to PATH as JSON (rank 0).

Besides these patches, 2-rank expert parallel on CPU needs two of torchtitan's own options:
`--parallelism.spmd_backend partial_dtensor` (the default `spmd_types` stops in FSDP init:
"When dp_mesh_dims is provided, all parameters must be DTensors on the full SPMD mesh ... Got
plain tensor for parameter 'weight'") and `--training.disable_cuda_graphs` (config validation
refuses the all-to-all dispatcher with EP otherwise; no CUDA graph runs on CPU anyway).
"""

from __future__ import annotations

import os
import resource
import sys
import types

import torch
import torch._utils

# 1. Device type: torchtitan.tools.utils reads this at import time.
torch._utils._get_available_device_type = lambda: "cpu"

import torchtitan.tools.utils as tt_utils  # noqa: E402

assert tt_utils.device_type == "cpu", tt_utils.device_type


class _CpuDeviceModule:
    """`torch.cpu` plus the accelerator-module calls torchtitan makes (memory stats, names)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    @staticmethod
    def set_device(device) -> None:
        pass

    @staticmethod
    def current_device() -> int:
        return 0  # an index, as torch.cuda returns (torch.cpu returns the string "cpu")

    @staticmethod
    def get_device_name(device=None) -> str:
        return "cpu"

    @staticmethod
    def get_device_properties(device=None):
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return types.SimpleNamespace(name="cpu", total_memory=total)

    @staticmethod
    def memory_stats(device=None) -> dict:
        # Peak resident set size of this process (KiB on Linux) stands in for device memory.
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"active_bytes.all.peak": peak, "reserved_bytes.all.peak": peak,
                "num_alloc_retries": 0, "num_ooms": 0}

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        pass

    @staticmethod
    def empty_cache() -> None:
        pass


# 2. Device module: every torchtitan module imported from here on sees the CPU shim.
tt_utils.device_module = _CpuDeviceModule()


class _TritonStub(types.ModuleType):
    """Just enough of `triton` / `triton.language` for a module of Triton kernels to import.

    `jit` returns the function unchanged (with or without arguments); any other attribute is a
    placeholder that can be called, indexed and looked into. No kernel ever runs.
    """

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _TritonPlaceholder()

    @staticmethod
    def jit(fn=None, **kwargs):
        return fn if fn is not None else (lambda f: f)


class _TritonPlaceholder:
    def __getattr__(self, name):
        return _TritonPlaceholder()

    def __call__(self, *args, **kwargs):
        return _TritonPlaceholder()

    def __getitem__(self, key):
        return _TritonPlaceholder()


def _import_without_triton() -> None:
    """torchtitan's MoE imports its MinimalAsyncEP Triton kernels at module level (every MoE
    model does, via token_dispatcher.py), and triton is not installed on this CPU machine. Import
    that module under a stub `triton`, then take the stub out of sys.modules again so torch
    never mistakes it for the real package (the benchmark uses the all-to-all dispatcher, never
    those kernels)."""
    if "triton" in sys.modules or _has_triton():
        return
    stub = _TritonStub("triton")
    stub.language = _TritonStub("triton.language")
    sys.modules["triton"], sys.modules["triton.language"] = stub, stub.language
    try:
        import torchtitan.distributed.minimal_async_ep.kernels  # noqa: F401
    finally:
        del sys.modules["triton"], sys.modules["triton.language"]


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


_import_without_triton()


def _sdpa_attention() -> None:
    """Causal SDPA instead of FlexAttention (which has no CPU backward in torch 2.13).

    torchtitan's trainer supports a maskless inner attention: it then passes positions (for
    RoPE) but no document masks, so attention is causal over the whole packed window, as in
    plait's model.
    """
    import torchtitan.models.deepseek_v3 as tt_deepseek_v3
    import torchtitan.models.llama3 as tt_llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    # Both model packages import get_attention_config into their own namespace (llama3 for its
    # attention, deepseek_v3 for the MLA's inner attention); patch each one.
    for module in (tt_llama3, tt_deepseek_v3):
        original = module.get_attention_config

        def get_attention_config(backend: str, _original=original):
            if backend in ("flex", "sdpa"):
                return ScaledDotProductAttention.Config()
            return _original(backend)

        module.get_attention_config = get_attention_config


# 3. Attention.
_sdpa_attention()

# 4. After step 1 torchtitan shortens the process-group timeouts with torch.distributed.set_timeout,
# which torch 2.13 does not have; one process has no collective to time out.
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402

tt_dist_utils.set_pg_timeouts = lambda *args, **kwargs: None


def _gloo_gradient_reduction() -> None:
    """torchtitan divides gradients itself and sets FSDP's divide factor to 1.0 on every FSDP
    module, which makes FSDP reduce-scatter with ReduceOp.PREMUL_SUM(1.0): NCCL-only, gloo
    raises "Cannot use ReduceOp.PREMUL_SUM with Gloo" (any run with 2+ FSDP ranks). Also ask
    those modules for plain-SUM reductions (FSDP's `set_force_sum_reduction_for_comms`), which
    then multiplies by the same factor 1.0 after the SUM: the same gradients."""
    import torchtitan.distributed.fsdp as tt_fsdp
    from torch.distributed.fsdp import FSDPModule

    original = tt_fsdp.disable_fsdp_gradient_division

    def disable_fsdp_gradient_division(model) -> None:
        original(model)
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_force_sum_reduction_for_comms(True)

    tt_fsdp.disable_fsdp_gradient_division = disable_fsdp_gradient_division


# 5. Gradient reduce-scatter with gloo.
_gloo_gradient_reduction()


def _count_dispatcher_syncs() -> None:
    """With PLAIT_BENCH_COUNT_TT_SYNCS=1: count calls of the all-to-all token dispatcher's
    `_sync_token_count_exchange` (on a GPU: one blocking and one non-blocking device-to-host copy
    of the split sizes, then `.tolist()` on the host copies) and print the count at exit (rank 0).
    Instrumentation only: the wrapped method runs unchanged."""
    if os.environ.get("PLAIT_BENCH_COUNT_TT_SYNCS") != "1":
        return
    import atexit

    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher

    calls = [0]
    original = AllToAllTokenDispatcher._sync_token_count_exchange

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    AllToAllTokenDispatcher._sync_token_count_exchange = counted
    if os.environ.get("RANK", "0") == "0":
        atexit.register(lambda: print(f"[tt-syncs] dispatcher host transfers: {calls[0]} calls",
                                      flush=True))


# 6. Optional count of the dispatcher's host transfers (benchmark instrumentation).
_count_dispatcher_syncs()


def _count_step_ops() -> None:
    """With PLAIT_BENCH_COUNT_OPS=PATH: count the ops of step PLAIT_BENCH_COUNT_OPS_STEP (default 2,
    after the first step's one-time work) of `Trainer.train_step` with plait's HostOpCounter
    (plan/host_ops.py imports only torch: loaded here by path), and write {ops, kernel_ops, by_op} to
    PATH (rank 0). The step's batches are drawn from the data iterator before counting (plait's
    step, too, is handed its batches). Instrumentation only: the step runs unchanged."""
    path = os.environ.get("PLAIT_BENCH_COUNT_OPS")
    if not path:
        return
    import importlib.util
    import json
    from pathlib import Path

    source = Path(__file__).resolve().parents[1] / "packages/plan/src/plait/plan/host_ops.py"
    spec = importlib.util.spec_from_file_location("plait_host_ops", source)
    host_ops = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(host_ops)
    from torchtitan.trainer import Trainer

    at = int(os.environ.get("PLAIT_BENCH_COUNT_OPS_STEP", "2"))
    original = Trainer.train_step

    def train_step(self, data_iterator):
        if self.step != at:
            return original(self, data_iterator)
        n = self.gradient_accumulation_steps * self.num_pipeline_parallel_microbatches
        batches = [next(data_iterator) for _ in range(n)]
        counter = host_ops.HostOpCounter()
        with counter:
            result = original(self, iter(batches))
        if os.environ.get("RANK", "0") == "0":
            Path(path).write_text(json.dumps({"ops": counter.ops(), "kernel_ops": counter.kernel_ops(),
                                              "by_op": dict(counter.by_op())}))
        return result

    Trainer.train_step = train_step


# 7. Optional count of the step's ops (benchmark instrumentation).
_count_step_ops()

if __name__ == "__main__":
    from torchtitan.train import main

    sys.argv[0] = "torchtitan.train"
    main()
