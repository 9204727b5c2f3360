"""Run torchtitan's training entry point on CPU: `python torchtitan_cpu.py <torchtitan args>`.

Meant to run inside the benchmark's torchtitan venv (see bench_trainer_vs_torchtitan.py), as a
single process (WORLD_SIZE=1). torchtitan 0.3.0 assumes an accelerator; these runtime patches
touch torchtitan (and which device torch reports to it) only, never plait:

  * report "cpu" as the available device type, so torchtitan picks `torch.cpu` as its device
    module and builds the model on CPU;
  * give torchtitan a CPU "device module" with the calls it makes on torch.cuda (set_device,
    device name and properties, memory stats: peak RSS stands in for device memory);
  * causal scaled-dot-product attention instead of FlexAttention, whose backward does not run on
    CPU (the same attention plait's model computes);
  * skip the process-group timeout change after step 1 (torch.distributed.set_timeout is not in
    torch 2.13; a single process has no collective to time out).
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


def _sdpa_attention() -> None:
    """Causal SDPA instead of FlexAttention (which has no CPU backward in torch 2.13).

    torchtitan's trainer supports a maskless inner attention: it then passes positions (for
    RoPE) but no document masks, so attention is causal over the whole packed window, as in
    plait's model.
    """
    import torchtitan.models.llama3 as tt_llama3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    original = tt_llama3.get_attention_config

    def get_attention_config(backend: str):
        if backend in ("flex", "sdpa"):
            return ScaledDotProductAttention.Config()
        return original(backend)

    tt_llama3.get_attention_config = get_attention_config


# 3. Attention.
_sdpa_attention()

# 4. After step 1 torchtitan shortens the process-group timeouts with torch.distributed.set_timeout,
# which torch 2.13 does not have; one process has no collective to time out.
import torchtitan.distributed.utils as tt_dist_utils  # noqa: E402

tt_dist_utils.set_pg_timeouts = lambda *args, **kwargs: None

if __name__ == "__main__":
    from torchtitan.train import main

    sys.argv[0] = "torchtitan.train"
    main()
