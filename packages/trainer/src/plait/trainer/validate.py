"""Every check that can fail a run, made before the first collective, each as one-line ConfigError.

A bad setting then stops every rank at once with a message naming the setting, instead of one
rank raising while the others hang in a collective.
"""

import importlib
import importlib.util
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from plait.mesh import ParallelConfigError, ParallelDims

from .config import Config, ConfigError
from .data_checks import build_checked_tokenizer, check_data
from .fault_tolerance import check_fault_tolerance
from .float8 import check_float8, check_float8_linears
from .float8_experts import check_float8_experts
from .loss_head import use_loss_head
from .machine_checks import check_comm, check_memory_fits
from .model_args import model_spec, resolve_model_args
from .mtp import check_mtp_seq_len, check_mtp_stages
from .optimizer import check_state_dtype
from .parallel_settings import cp_config, ep_config, optional_parallel_module, pipeline_microbatches, tp_config
from .size_bound import check_size_bound
from .wandb_logger import check_wandb

# The full model is materialised on every rank before sharding (init = auto) below this size.
FULL_INIT_MAX_BYTES = 8 * 2**30


@dataclass
class RunPlan:
    """What validation established: the degrees, the model (on meta), its metadata, the tokenizer."""

    dims: ParallelDims
    model_args: Any
    model: nn.Module  # on the meta device
    info: dict
    tokenizer: Any
    full_init: bool
    parallel_modules: dict  # "tp"/"cp"/"ep"/"pp" -> imported module, for the degrees > 1


def _check_positive(config: Config) -> None:
    checks = {
        "training.steps": config.training.steps,
        "training.local_batch_size": config.training.local_batch_size,
        "training.seq_len": config.training.seq_len,
        "training.gradient_accumulation_steps": config.training.gradient_accumulation_steps,
        "training.activation_checkpoint_every": config.training.activation_checkpoint_every,
        "metrics.log_freq": config.metrics.log_freq,
        "data.val_steps": config.data.val_steps,
    }
    for key, value in checks.items():
        if value < 1:
            raise ConfigError(f"{key} = {value}: must be >= 1.")
    nonneg = {
        "optimizer.lr": config.optimizer.lr,
        "optimizer.weight_decay": config.optimizer.weight_decay,
        "optimizer.eps": config.optimizer.eps,
        "training.max_norm": config.training.max_norm,
        "lr_scheduler.warmup_steps": config.lr_scheduler.warmup_steps,
        "data.val_interval": config.data.val_interval,
        "metrics.profile_interval": config.metrics.profile_interval,
        "checkpoint.interval": config.checkpoint.interval,
        "checkpoint.keep_last": config.checkpoint.keep_last,
        "job.stop_grace_s": config.job.stop_grace_s,
        "metrics.cpu_peak_tflops": config.metrics.cpu_peak_tflops,
        "training.loss_chunk_tokens": config.training.loss_chunk_tokens,
    }
    for key, value in nonneg.items():
        if value < 0:
            raise ConfigError(f"{key} = {value}: must be >= 0.")
    if config.parallelism.expert_capacity_factor < 0:  # checked at ep 1 too, where it is unused
        raise ConfigError(f"parallelism.expert_capacity_factor = {config.parallelism.expert_capacity_factor}: use 0 "
                          "(dropless) or a factor > 0.")
    for i, beta in enumerate(config.optimizer.betas):
        if not 0.0 <= beta < 1.0:
            raise ConfigError(f"optimizer.betas[{i}] = {beta}: must be in [0, 1).")
    if not 0.0 <= config.lr_scheduler.min_lr_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.min_lr_ratio = {config.lr_scheduler.min_lr_ratio}: must be in [0, 1].")
    if not 0.0 < config.lr_scheduler.decay_ratio <= 1.0:
        raise ConfigError(f"lr_scheduler.decay_ratio = {config.lr_scheduler.decay_ratio}: must be in (0, 1].")
    if config.data.val_interval and not config.data.val_dataset:
        raise ConfigError("data.val_interval is set but data.val_dataset is empty: name a validation dataset.")
    if not config.job.collective_timeout_s > 0:
        raise ConfigError(f"job.collective_timeout_s = {config.job.collective_timeout_s}: must be > 0 seconds.")
    if not 0 <= config.job.seed < 2**63:
        raise ConfigError(f"job.seed = {config.job.seed}: must be in [0, 2^63) (torch's and numpy's seed range).")
    _check_pipeline_settings(config)


def _check_pipeline_settings(config: Config) -> None:
    """The pipeline settings, at pp 1 too: a typo must not wait until the run that uses pp > 1."""
    p = config.parallelism
    for key in ("pipeline_microbatch_size", "pipeline_virtual_stages"):
        if getattr(p, key) < 1:
            raise ConfigError(f"parallelism.{key} = {getattr(p, key)}: must be >= 1.")
    if any(n < 0 for n in p.layers_per_stage):  # 0 is allowed: a stage of only the embedding or the head
        raise ConfigError(f"parallelism.layers_per_stage = {p.layers_per_stage}: a stage's block count must be >= 0.")
    if p.layers_per_stage and p.pp == 1:  # it would be ignored: a user who set it meant to pipeline
        raise ConfigError(f"parallelism.layers_per_stage = {p.layers_per_stage} applies to pipeline stages, and "
                          "parallelism.pp = 1: set parallelism.pp, or drop layers_per_stage "
                          "(--parallelism.layers_per_stage '')")  # fmt: skip
    try:
        from plait.pipelineparallel.config import schedule_name
    except ImportError:  # plait-pipelineparallel not installed (pp > 1 says so itself): torch's names
        from torch.distributed.pipelining.schedules import get_schedule_class

        def schedule_name(name):
            try:
                get_schedule_class(name)
            except ValueError:
                raise ValueError(f"parallelism.pipeline_schedule = {name!r} is not a pipeline schedule: use one of "
                                 "1F1B, Interleaved1F1B, GPipe, LoopedBFS, InterleavedZeroBubble, ZBVZeroBubble, "
                                 "DualPipeV.") from None
    try:
        schedule_name(p.pipeline_schedule)
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _check_data_parallel(config: Config, dims: ParallelDims) -> None:
    p = config.parallelism
    if p.replicate_impl != "ddp" or dims.dp_replicate == 1:
        return
    others = {k: getattr(dims, k) for k in ("dp_shard", "cp", "tp", "ep") if getattr(dims, k) > 1}
    if others:
        raise ConfigError(
            f"parallelism.replicate_impl = 'ddp' does not compose with {others}: DDP only replicates plain "
            "tensors. Use parallelism.replicate_impl = 'fsdp'."
        )
    if config.training.dtype != "float32":
        raise ConfigError(
            f"parallelism.replicate_impl = 'ddp' with training.dtype = '{config.training.dtype}': DDP has no "
            "mixed-precision policy. Use parallelism.replicate_impl = 'fsdp' (replicate with bf16 compute and "
            "fp32 gradient reduction), or training.dtype = 'float32'."
        )


def _check_checkpoint(config: Config, world_size: int) -> None:
    c = config.checkpoint
    if c.load_step < -1:
        raise ConfigError(f"checkpoint.load_step = {c.load_step}: use a saved step, or -1 for the newest checkpoint.")
    if c.create_seed_checkpoint and world_size > 1:
        raise ConfigError(
            f"checkpoint.create_seed_checkpoint = true runs on one process, not {world_size}: drop --nproc-per-node "
            "(runs on any layout then start from the seed)."
        )
    if not c.enable:
        for key, value, default in (("interval", c.interval, 0), ("load_step", c.load_step, -1),
                                    ("last_save_in_hf", c.last_save_in_hf, False)):
            if value != default:
                raise ConfigError(
                    f"checkpoint.{key} = {value} but checkpoint.enable = false: set checkpoint.enable = true "
                    "to save and resume checkpoints."
                )
    if c.initial_load_hf and not c.initial_load_path:
        raise ConfigError("checkpoint.initial_load_hf = true needs checkpoint.initial_load_path (a Hugging Face folder).")
    if c.initial_load_path and not os.path.isdir(c.initial_load_path):
        raise ConfigError(f"checkpoint.initial_load_path = {c.initial_load_path!r}: no such folder.")


def _check_hf_weights(config: Config, model_args) -> None:
    """A Hugging Face folder to start from is the configured model and flavor (config.json only)."""
    c = config.checkpoint
    if not (c.initial_load_hf and c.initial_load_path):
        return
    from plait.checkpoint.hf_export import check_hf_folder
    from plait.checkpoint.store import CheckpointError

    try:
        check_hf_folder(c.initial_load_path, config.model.name, config.model.flavor, model_args)
    except CheckpointError as e:
        raise ConfigError(str(e)) from None


def _check_hf_export(config: Config, spec, model_args) -> None:
    """The model can be written as a Hugging Face checkpoint (checkpoint.last_save_in_hf), checked
    by building its config.json now rather than failing after the whole run."""
    c = config.checkpoint
    if not (c.enable and c.last_save_in_hf):
        return
    try:
        spec.hf_adapter.hf_config(model_args)
    except (ValueError, KeyError) as e:  # the adapter's line names its fix (plait.models.hf)
        raise ConfigError(f"checkpoint.last_save_in_hf = true but {config.model.name} {config.model.flavor} cannot "
                          f"be exported: {str(e).splitlines()[0]}; or set checkpoint.last_save_in_hf = false "
                          "(the DCP checkpoints are written either way).") from None


def _writable_folder_problem(path: str) -> str | None:
    """Why `path` cannot become a folder this process writes into, or None. Creates nothing: the
    nearest existing ancestor must be a writable folder (access(2) also sees read-only mounts)."""
    if not path:
        return "is empty"
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"is not a folder ({probe} is a file)"
    if not os.access(probe, os.W_OK | os.X_OK):
        return f"is not writable ({probe} is read-only for this user)"
    return None


def _check_folders(config: Config) -> None:
    """The run's folders are writable before anything trains (not an OSError at the first save)."""
    folders = [("job.dump_folder", config.job.dump_folder)]
    c = config.checkpoint
    if c.enable or c.create_seed_checkpoint:
        if not c.folder:
            raise ConfigError('checkpoint.folder = "": name a folder (relative to job.dump_folder, or absolute).')
        folders.append(("checkpoint.folder", os.path.join(config.job.dump_folder, c.folder)))
    for key, path in folders:
        problem = _writable_folder_problem(path)
        if problem:
            raise ConfigError(f"{key} = {path!r} {problem}: set {key} to a folder this user can write.")


def _parallel_dims(config: Config, world_size: int) -> ParallelDims:
    p = config.parallelism
    try:
        return ParallelDims(
            pp=p.pp,
            dp_replicate=p.dp_replicate,
            dp_shard=p.dp_shard,
            cp=p.cp,
            tp=p.tp,
            ep=p.ep,
            etp=p.etp,
            world_size=world_size,
        )
    except ParallelConfigError as e:
        raise ConfigError(str(e)) from None


def validate(config: Config, world_size: int | None = None, check_memory: bool = False,
             need_data: bool = True) -> RunPlan:
    """Check the whole configuration locally (no collective); raise ConfigError on the first problem.
    `check_memory`: also refuse a run whose estimated per-rank peak exceeds this machine's device
    memory (training.memory_check) — for the run about to start here (the trainer's ranks, the
    launcher), not for a layout checked on another machine's behalf. `need_data = False` (plait-plan,
    which plans for another machine): no data source is read and no tokenizer is built (the plan's
    `tokenizer` is None; the model's vocab_size stands for it), every other check as plait-train's."""
    world_size = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", 1))
    _check_positive(config)
    check_float8(config)
    check_state_dtype(config.optimizer)
    dims = _parallel_dims(config, world_size)
    # Optional parallel packages, before anything is built with them.
    parallel_modules = {
        axis: optional_parallel_module(axis, getattr(dims, axis))
        for axis in ("tp", "cp", "ep", "pp") if getattr(dims, axis) > 1
    }
    _check_checkpoint(config, world_size)
    if need_data:  # the run starts here (plait-plan plans for another machine)
        check_comm(config, world_size)
    _check_folders(config)
    check_wandb(config)  # metrics.wandb needs wandb importable
    spec = model_spec(config)
    model_args = resolve_model_args(config, spec)
    _check_seq_len(config, model_args)
    check_mtp_stages(config, dims, model_args)
    check_mtp_seq_len(config, model_args)
    if check_memory:
        check_size_bound(config, spec, model_args, world_size)  # before a build that is minutes at 10^5 layers
    _check_data_parallel(config, dims)
    check_fault_tolerance(config, dims)
    check_data(config, read_sources=need_data)
    _check_hf_weights(config, model_args)
    _check_hf_export(config, spec, model_args)
    tokenizer = build_checked_tokenizer(config, model_args) if need_data else None

    with torch.device("meta"):
        model = spec.model_cls(model_args)
    info = model.parallel_info()
    use_loss_head(model, info, config)  # training.loss = chunked: `output` fused with the loss
    check_float8_linears(config, model)
    _check_parallel_fit(config, dims, parallel_modules, model, model_args, info)
    # The GPU's kind is this machine's unless plait-plan checks a layout for another one.
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    check_float8_experts(config, [model.get_submodule(p) for p in info.get("experts", ())], capability,
                         device_known=need_data, etp=dims.etp)  # fmt: skip
    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    full_init = config.model.init == "full" or (config.model.init == "auto" and n_bytes <= FULL_INIT_MAX_BYTES)
    if config.training.compile and not _has_compiler():
        raise ConfigError("training.compile = true needs a C++ compiler on CPU (or triton on GPU); none was found.")
    if config.training.compile_mode != "default":
        _validate_cuda_graphs(config, dims)
    if check_memory:
        check_memory_fits(config, dims, model, info, world_size)
    return RunPlan(dims, model_args, model, info, tokenizer, full_init, parallel_modules)


def _check_seq_len(config: Config, model_args) -> None:
    seq_len, max_seq_len = config.training.seq_len, model_args.max_seq_len
    if seq_len > max_seq_len:
        raise ConfigError(
            f"training.seq_len = {seq_len} is longer than {config.model.name} {config.model.flavor}'s max_seq_len = "
            f"{max_seq_len} (seq_len not matching the model): lower training.seq_len, or raise model.max_seq_len "
            f"(--model.max_seq_len {seq_len}; RoPE tables cover it)."
        )


def _check_parallel_fit(config: Config, dims: ParallelDims, parallel_modules: dict, model: nn.Module,
                        model_args, info: dict) -> None:
    """Each parallel package's own validation of this model (on meta) at these degrees."""
    if dims.ep > 1 and not info.get("experts"):
        raise ConfigError(
            f"parallelism.ep = {dims.ep} but {config.model.name} {config.model.flavor} has no routed experts: set ep = 1."
        )
    if dims.ep > 1:
        num_experts = model.get_submodule(info["experts"][0]).w1.shape[0]
        try:
            parallel_modules["ep"].validate_expert_parallel(
                num_experts, dims.ep, dims.tp, dims.etp, ep_config(parallel_modules["ep"], config)
            )
        except ValueError as e:
            raise ConfigError(str(e).splitlines()[0]) from None
    if dims.tp > 1:
        _validate_tp(parallel_modules["tp"], model, info, dims, config)
    if dims.cp > 1:
        _validate_cp(parallel_modules["cp"], model_args, info, dims, config)
    if dims.pp > 1:
        _validate_pp(parallel_modules["pp"], info, dims, config)


def _validate_cuda_graphs(config: Config, dims: ParallelDims) -> None:
    """What CUDA graph capture of the compiled blocks needs (docs/cuda_graphs.md)."""
    mode = config.training.compile_mode
    if not config.training.compile:
        raise ConfigError(f"training.compile_mode = {mode} applies to compiled blocks: set training.compile = true.")
    if dims.ep > 1 and config.parallelism.expert_capacity_factor == 0:
        raise ConfigError(
            f"training.compile_mode = {mode}: dropless expert parallel reads its split sizes on the host and "
            "its shapes follow the routing, so a graph would be re-recorded for every token count; set "
            "parallelism.expert_capacity_factor > 0 (static shapes, no host sync) or compile_mode = default."
        )
    if dims.dp_shard_cp > 1 or dims.efsdp > 1:
        raise ConfigError(
            f"training.compile_mode = {mode}: FSDP / HSDP free and re-allocate the unsharded parameters every "
            "step, which a CUDA graph cannot follow; use dp_shard = cp = 1 (replicate, DDP, TP, expert capacity "
            "mode without expert FSDP) or compile_mode = default."
        )


def _validate_tp(tp_module, model: nn.Module, info: dict, dims: ParallelDims, config: Config) -> None:
    try:
        tp_module.validate_tensor_parallel(info, dims.tp, config.training.seq_len, tp_config(tp_module, config))
    except ValueError as e:  # TensorParallelConfigError and ParallelConfigError are ValueErrors
        raise ConfigError(str(e).splitlines()[0]) from None


def _validate_cp(cp_module, model_args, info: dict, dims: ParallelDims, config: Config) -> None:
    try:
        cp_module.validate_context_parallel(
            info, dims.cp, config.training.seq_len, cp_config(cp_module, config, info), dims.tp,
            attention_mask=getattr(model_args, "attention_mask", "causal"),
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _validate_pp(pp_module, info: dict, dims: ParallelDims, config: Config) -> None:
    p = config.parallelism
    if p.replicate_impl == "ddp" and dims.dp_replicate > 1:
        raise ConfigError(
            f"parallelism.pp = {dims.pp} with parallelism.replicate_impl = 'ddp': use replicate_impl = 'fsdp'."
        )
    try:
        pp_module.validate_pipeline_parallel(
            info, dims.pp, p.pipeline_schedule, pipeline_microbatches(config),
            list(p.layers_per_stage) or None, p.pipeline_virtual_stages,
        )
    except ValueError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


def _has_compiler() -> bool:
    if torch.cuda.is_available():
        return importlib.util.find_spec("triton") is not None
    import shutil

    return any(shutil.which(cc) for cc in ("g++", "c++", "clang++"))
