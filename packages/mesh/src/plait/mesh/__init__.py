"""plait.mesh: parallel degrees -> one validated world DeviceMesh with named views.

Also process-group start-up (`init_distributed`: nccl, or gloo where ranks share a GPU, with
point-to-point staged through host memory), mesh-aware gradient clipping, the errors every
package reports alike (`plait.mesh.errors`) and `declared_sync` (a host sync made on purpose).
Tests run on plait-testing (`run_on_ranks`, the step sentinel).
"""

from .device_mesh import Meshes, build_meshes
from .distributed import (
    BACKENDS,
    DistributedInfo,
    collectives_on_gloo,
    comm_problem,
    destroy_distributed,
    device_type,
    elastic_problem,
    init_distributed,
)
from .errors import ConfigError
from .grad_norm import clip_grad_norm_, grad_norm
from .parallel_dims import ParallelConfigError, ParallelDims

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "ConfigError",
    "DistributedInfo",
    "Meshes",
    "ParallelConfigError",
    "ParallelDims",
    "build_meshes",
    "clip_grad_norm_",
    "collectives_on_gloo",
    "comm_problem",
    "destroy_distributed",
    "device_type",
    "elastic_problem",
    "grad_norm",
    "init_distributed",
]
