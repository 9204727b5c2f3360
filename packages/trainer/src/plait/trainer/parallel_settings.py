"""The settings each optional parallel package takes, built from the [parallelism] section, and
the import of that package (a missing or outdated one is a ConfigError naming what to install)."""

import importlib
import importlib.util

from .config import Config, ConfigError

# Parallelisms that live in optional packages: degree field -> (import name, pip name, entry point).
OPTIONAL_PARALLEL = {
    "tp": ("plait.tensorparallel", "plait-tensorparallel", "apply_tensor_parallel"),
    "cp": ("plait.contextparallel", "plait-contextparallel", "apply_context_parallel"),
    "ep": ("plait.expertparallel", "plait-expertparallel", "apply_expert_parallel"),
    "pp": ("plait.pipelineparallel", "plait-pipelineparallel", "build_pipeline"),
}


def optional_parallel_module(axis: str, degree: int):
    """Import the package that implements `axis`, or a ConfigError naming what to install."""
    module_name, pip_name, entry = OPTIONAL_PARALLEL[axis]
    try:
        found = importlib.util.find_spec(module_name) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise ConfigError(f"parallelism.{axis} = {degree} needs {pip_name}: pip install {pip_name}.")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a broken install must not crash with a traceback here
        raise ConfigError(
            f"parallelism.{axis} = {degree}: importing {module_name} failed ({e}); reinstall {pip_name}."
        ) from None
    if not hasattr(module, entry):
        version = getattr(module, "__version__", "?")
        raise ConfigError(
            f"parallelism.{axis} = {degree} needs {entry} from {pip_name}, which the installed version ({version}) "
            f"lacks: install {pip_name} with it (pip install -U {pip_name}), or set "
            f"parallelism.{axis} = 1."
        )
    return module


def pipeline_microbatches(config: Config) -> int:
    """Pipeline micro-batches per step: the accumulation micro-batches run as one local batch."""
    from plait.pipelineparallel import n_microbatches

    t = config.training
    return n_microbatches(t.local_batch_size * t.gradient_accumulation_steps, config.parallelism.pipeline_microbatch_size)


def ep_config(ep_module, config: Config):
    """plait.expertparallel's config from the [parallelism] section."""
    # Every rank's micro-batch is [local_batch_size, seq_len] (cp shards equal): capacity mode's
    # blocks are equal by construction, so it needs no row check (and no host sync) before them.
    return ep_module.ExpertParallelConfig(
        capacity_factor=config.parallelism.expert_capacity_factor, rows_equal_by_construction=True
    )


def cp_config(cp_module, config: Config, info: dict | None = None):
    """plait.contextparallel's config from the [parallelism] section; with the model's
    `parallel_info()`, the CPU kernel route of its half-precision attention (plait.models.cpu_bf16
    decides for the model's head dim; context parallel takes the answer)."""
    from plait.models import cpu_bf16

    p = config.parallelism
    head_dim = (info or {}).get("attention_heads", {}).get("head_dim")
    in_fp32 = cpu_bf16.cpu_attends_in_fp32(head_dim) if head_dim is not None else False
    return cp_module.ContextParallelConfig(
        method=p.cp_method, load_balance=p.cp_load_balance, load_balance_rounds=p.cp_load_balance_rounds,
        cpu_half_in_fp32=in_fp32,
    )


def tp_config(tp_module, config: Config):
    """plait.tensorparallel's config from the [parallelism] section."""
    p = config.parallelism
    return tp_module.TensorParallelConfig(
        sequence_parallel=p.sequence_parallel, loss_parallel=p.loss_parallel, async_tp=p.async_tp
    )
