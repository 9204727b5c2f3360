"""plait.mesh: parallel degrees -> one validated world DeviceMesh with named views.

Also process-group start-up (`init_distributed`), mesh-aware gradient clipping, the errors every
package reports alike (`plait.mesh.errors`) and `declared_sync` (a host sync made on purpose).
Tests run on plait-testing (`run_on_ranks`, the step sentinel).
"""

from .device_mesh import Meshes, build_meshes
from .distributed import DistributedInfo, destroy_distributed, device_type, init_distributed
from .grad_norm import clip_grad_norm_, grad_norm
from .parallel_dims import ParallelConfigError, ParallelDims

__version__ = "0.1.0"

__all__ = [
    "DistributedInfo",
    "Meshes",
    "ParallelConfigError",
    "ParallelDims",
    "build_meshes",
    "clip_grad_norm_",
    "destroy_distributed",
    "device_type",
    "grad_norm",
    "init_distributed",
]
