"""Async tensor parallel: overlap sequence parallel's collectives with the matmuls beside them.

torch's micro-pipeline TP pass (an inductor pass, so the blocks must be compiled) rewrites
all-gather -> matmul and matmul -> reduce-scatter into chunked, overlapped kernels over symmetric
memory. This only switches it on for the tp group; `torch.compile` of the blocks does the rest.
"""

import torch
from torch.distributed.device_mesh import DeviceMesh

from .config import TensorParallelConfigError


def enable_async_tp(tp_mesh: DeviceMesh) -> None:
    """Turn on micro-pipeline TP for `tp_mesh`'s group. CUDA only; compile the blocks afterwards."""
    if tp_mesh.device_type != "cuda":
        raise TensorParallelConfigError(
            f"parallelism.async_tp = true needs CUDA: the tp mesh is on {tp_mesh.device_type!r}. "
            "Set parallelism.async_tp = false."
        )
    from torch.distributed._symmetric_memory import enable_symm_mem_for_group

    torch._inductor.config._micro_pipeline_tp = True
    enable_symm_mem_for_group(tp_mesh.get_group().group_name)
