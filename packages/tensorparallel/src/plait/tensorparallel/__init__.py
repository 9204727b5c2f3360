"""plait.tensorparallel: Tensor parallel, sequence parallel and loss parallel from a model's plan strings.

    validate_tensor_parallel(model.parallel_info(), tp, seq_len, config)   # before any collective
    apply_tensor_parallel(model, meshes.tp, model.parallel_info()["tp_plan"], config)
    with loss_parallel_context(uses_loss_parallel(plan, config, tp)):
        loss = cross_entropy(model(tokens).flatten(0, 1), labels.flatten())
        loss.backward()
"""

from .async_tp import enable_async_tp
from .config import TensorParallelConfig, TensorParallelConfigError, validate_tensor_parallel
from .loss import loss_parallel_context
from .plan import PLAN_STRINGS, apply_tensor_parallel, build_style, parse_plan_string, uses_loss_parallel

__version__ = "0.1.1"

__all__ = [
    "PLAN_STRINGS",
    "TensorParallelConfig",
    "TensorParallelConfigError",
    "apply_tensor_parallel",
    "build_style",
    "enable_async_tp",
    "loss_parallel_context",
    "parse_plan_string",
    "uses_loss_parallel",
    "validate_tensor_parallel",
]
