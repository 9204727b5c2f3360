"""The step sentinel (tests only): what would stall or break a GPU, seen on a CPU run.

`with StepSentinel() as s:` around a training step records

- host syncs: every operation that blocks the host on a GPU (`.item()`, `.tolist()`, `bool(t)`,
  `nonzero`, boolean-mask indexing, ops whose output shape depends on the data, `equal` /
  `allclose`, tensors built from Python data on the compute device, copies to the CPU);
- precondition violations: tensors handed to a kernel or collective that break what its CUDA
  implementation requires (SDPA flash / efficient / cudnn inputs with a strided last dim or a
  non-contiguous logsumexp, a causal block that is not square, `_grouped_mm` offsets / strides /
  alignment, non-contiguous collective buffers, and the inputs of plait's own kernel ops:
  `plait::document_attention` against FlashAttention-2 varlen's, `plait::grouped_mm` against
  `_grouped_mm`'s). CPU kernels honour any stride, so these pass every CPU test and break on CUDA.
  A plait op is one kernel on a GPU: what its CPU kernel does inside (reading the document offsets
  on the host) is not judged, its inputs are.

Each record names the first source line outside torch and this package. Two layers see them: on a
CPU run most syncs are no-ops that never reach the dispatcher (`.tolist()`, `.cpu()`), so the
Tensor methods and `torch.*` constructors are wrapped while a sentinel is entered (this also holds
inside autograd backward and hooks, where a TorchFunctionMode would be popped); a
TorchDispatchMode sees the aten ops (the syncs that C++ issues, kernel and collective arguments).
It lets tensor subclasses (DTensor, functional-collective tensors) run first, so it checks the
local tensors and the collectives they issue. A sync already recorded at the function layer is
not recorded again by the aten ops it runs.

Code that syncs on purpose (the dropless expert-parallel dispatch's split sizes) wraps the sync
in `plait.mesh.declared_sync("why")`: it still counts, its detail says `declared: why`.

Its modules, one job each:

    records    `Record`, the entered sentinels, where a record comes from
    host       the compute device, tensors that are host data on purpose, masked-fill assignments
    functions  the function layer: the wrapped Tensor methods and torch.* functions
    kernels    the CUDA preconditions of SDPA, _grouped_mm, plait's kernel ops and collectives
    aten       the aten layer: the TorchDispatchMode
    step       `StepSentinel`
"""

from plait.mesh.declared_sync import declared_sync

from .records import Record
from .step import StepSentinel

__all__ = ["Record", "StepSentinel", "declared_sync"]
