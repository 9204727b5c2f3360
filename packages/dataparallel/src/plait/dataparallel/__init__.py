"""plait.dataparallel: FSDP2, HSDP, DDP and the FSDP-based replicate, with mixed precision by policy.

`apply_data_parallel(model, meshes, blocks, config)` picks the mode from the degrees in
`meshes.dims`; `autocast_context(meshes, config, device_type)` wraps the forward (autocast only on
a single process). See the README.
"""

from .api import apply_data_parallel
from .config import DataParallelConfig, data_parallel_mode
from .precision import autocast_context

__version__ = "0.1.0"

__all__ = ["DataParallelConfig", "apply_data_parallel", "autocast_context", "data_parallel_mode"]
