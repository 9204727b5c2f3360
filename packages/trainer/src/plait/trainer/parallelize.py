"""Model on meta -> tensor parallel -> context parallel -> expert parallel -> activation
checkpointing -> compile per block -> data parallel.

Initial weights are the same on every layout: with `full_init` (the default whenever the fp32
model fits in a few GiB) every rank materialises the whole model on its device, seeds the RNG
with job.seed and runs `init_weights()` before anything is sharded; tensor and data parallel
then shard those existing full tensors, so rank r's shard is exactly the slice of the 1-rank
model (parity from step 1). Models too large for that are parallelised on the meta device and
only their local shards are materialised and initialised (`init = "sharded"`).
"""

import contextlib
from dataclasses import dataclass, replace

import torch
from torch import nn

from plait.mesh import Meshes, ParallelConfigError

from . import pipeline
from .activation_checkpoint import apply_activation_checkpointing
from .config import Config, ConfigError
from .float8 import convert_to_float8, describe
from .float8_experts import convert_experts_to_float8
from .fsdp_tp import fsdp_post_forward_first
from .log import log
from .loss_head import loss_head_of, take_labels
from .validate import RunPlan, cp_config, ep_config, tp_config


@dataclass
class ParallelModel:
    model: nn.Module  # what to call (a DDP wrapper under replicate_impl = "ddp")
    inner: nn.Module  # the plait model itself
    dp_mode: str  # none, fsdp, hsdp, replicate, ddp
    autocast: contextlib.AbstractContextManager | None  # for forward + loss, or None
    loss_parallel: bool
    cp_layout: object | None = None  # plait.contextparallel.SequenceLayout the batch is sharded in
    dispatchers: dict | None = None  # expert parallel: module path -> token dispatcher
    stages: list | None = None  # pipeline parallel: this rank's plait.pipelineparallel Stages
    float8_all_gather: bool = False  # FSDP gathers float8 weights: their scales follow each optimizer step


def compile_kwargs(training) -> dict:
    """torch.compile's arguments for each block (`training.compile_mode`, `compile_comm_overlap`)."""
    if training.compile_mode != "default":
        return {"mode": training.compile_mode}  # torch takes a mode or inductor options, not both
    return {"options": {"reorder_for_compute_comm_overlap": True}} if training.compile_comm_overlap else {}


def _dtype(config: Config) -> torch.dtype:
    return torch.bfloat16 if config.training.dtype == "bfloat16" else torch.float32


def _explicit_prefetch(config: Config, device_type: str | None) -> bool:
    policy = config.parallelism.fsdp_prefetch
    if policy == "auto":
        # CPU has no streams, so no implicit prefetch: plait.dataparallel issues gloo's all-gathers
        # async there, and only an explicit prefetch starts one before its block needs it.
        return config.parallelism.ep > 1 or device_type == "cpu"
    return policy == "explicit"


def data_parallel_config(config: Config, device_type: str | None = None):
    """`device_type`: where the run trains ("cpu", "cuda"); it decides fsdp_prefetch = auto."""
    from plait.dataparallel import DataParallelConfig

    dtype = _dtype(config)
    return DataParallelConfig(
        param_dtype=dtype if dtype != torch.float32 else None,
        reduce_dtype=torch.float32,
        reshard_after_forward=config.parallelism.reshard_after_forward,
        replicate_impl=config.parallelism.replicate_impl,
        prefetch=_explicit_prefetch(config, device_type),
    )


def _init(model: nn.Module, device: torch.device, seed: int) -> None:
    model.to_empty(device=device)
    # Same seed on every rank and layout: init draws the same numbers for the same full tensors.
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
        model.init_weights(buffer_device=device)


def parallelize(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device) -> ParallelModel:
    """Apply every parallelism in the fixed order; the packages' own local checks (the same on
    every rank, before their first collective, all ParallelConfigError) surface as ConfigError."""
    try:
        return _parallelize(config, plan, meshes, device)
    except ParallelConfigError as e:
        raise ConfigError(str(e).splitlines()[0]) from None


@dataclass
class _Part:
    """One module to parallelise: the whole model, or one pipeline stage (pipeline.py)."""

    module: nn.Module
    blocks: list[str]
    edge_units: tuple | list
    tp_plan: dict
    attention_modules: list[str]
    experts: list[str]


def _parallelize(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device) -> ParallelModel:
    from plait.dataparallel.config import data_parallel_mode

    model, info = plan.model, plan.info
    if plan.full_init:
        _init(model, device, config.job.seed)
    elif device.type == "cpu" and meshes.dims.world_size > 1 and not config.checkpoint.initial_load_path:
        # DTensor's random ops need a device RNG with offsets (CUDA-like); on CPU every rank
        # would draw the same numbers for its own shard.
        log.warning("model.init = sharded on CPU gives every shard the same random numbers; use model.init = "
                    "full, or start from a seed checkpoint (--checkpoint.create_seed_checkpoint, then "
                    "--checkpoint.initial_load_path).")
    float8_all_gather = _float8(config, model, list(info.get("experts", ())), meshes, device.type)
    stages = None
    if meshes.dims.pp > 1:
        stages = pipeline.split_stages(config, plan, meshes)
        parts = [_Part(s.module, s.blocks, s.edge_units, pipeline.stage_plan(info.get("tp_plan", {}), s.module),
                       pipeline.owned(info.get("attention_modules", []), s.module),
                       pipeline.owned(info.get("experts", ()), s.module)) for s in stages]  # fmt: skip
        # Micro-batches reuse the gathered parameters between their forward and backward, and torch
        # 2.13's zero-bubble schedules lose weight gradients when FSDP reshards after forward.
        dp_config = replace(data_parallel_config(config), reshard_after_forward="never")
    else:
        parts = [_Part(model, list(info["blocks"]), info.get("edge_units", ()), info.get("tp_plan", {}),
                       info.get("attention_modules", []), list(info.get("experts", ())))]  # fmt: skip
        dp_config = data_parallel_config(config, device.type)
    dp_mode = data_parallel_mode(meshes.dims, dp_config)
    loss_parallel, cp_layout, dispatchers, wrapped = False, None, {}, None
    for part in parts:
        part_loss_parallel, part_layout, part_dispatchers, wrapped = _parallelize_part(
            config, plan, meshes, device, part, dp_config, dp_mode
        )
        loss_parallel = loss_parallel or part_loss_parallel
        cp_layout = part_layout if part_layout is not None else cp_layout  # the same on every stage
        dispatchers.update(part_dispatchers or {})
    if stages is not None:
        wrapped = model = pipeline.StageUnion([s.module for s in stages])
    return ParallelModel(wrapped, model, dp_mode, _autocast(config, meshes, dp_config, dp_mode, device),
                         loss_parallel, cp_layout, dispatchers or None, stages=stages,
                         float8_all_gather=float8_all_gather)  # fmt: skip


def _float8(config: Config, model: nn.Module, experts: list[str], meshes: Meshes, device_type: str) -> bool:
    """training.float8 / float8_experts: convert the linears and the experts' grouped GEMMs before
    any parallelism sees them; whether FSDP gathers the weights in float8 (tensorwise, with a
    sharding data parallel)."""
    if config.training.float8_experts != "off":
        log.info(convert_experts_to_float8(model, experts, config, device_type))
    if config.training.float8 == "off":
        return False
    from plait.dataparallel.config import data_parallel_mode

    mode = data_parallel_mode(meshes.dims, data_parallel_config(config))
    all_gather = config.training.float8 == "tensorwise" and mode in ("fsdp", "hsdp")
    converted = convert_to_float8(model, config, all_gather, device_type)
    log.info(describe(converted, config))
    return all_gather and bool(converted)


def _parallelize_part(config: Config, plan: RunPlan, meshes: Meshes, device: torch.device, part: _Part,
                      dp_config, dp_mode: str):  # fmt: skip
    """TP, CP, EP, activation checkpointing, compile per block, data parallel and (sharded) init on
    one part, in that order: (loss parallel, the CP sequence layout, the EP dispatchers, the
    module to call)."""
    from plait.dataparallel import apply_data_parallel

    module, info, dims = part.module, plan.info, meshes.dims
    loss_parallel, cp_layout, dispatchers = False, None, None
    if config.training.loss == "chunked":
        take_labels(module)  # the model call's labels, to its loss head (loss_head.py)
    if dims.tp > 1:
        tp = plan.parallel_modules["tp"]
        tp_cfg = tp_config(tp, config)
        if dims.ep > 1 and dims.etp == 1:
            # Expert parallel keeps these experts whole (etp = 1) and owns them.
            tp_cfg = replace(tp_cfg, external_modules=tuple(info["experts"]))
        tp.apply_tensor_parallel(module, meshes.tp, part.tp_plan, tp_cfg)
        loss_parallel = tp.uses_loss_parallel(info["tp_plan"], tp_cfg, dims.tp)
    if dims.cp > 1:
        cp = plan.parallel_modules["cp"]
        cp_layout = cp.apply_context_parallel(module, meshes.cp, part.attention_modules, cp_config(cp, config, info))
    if dims.ep > 1 and part.experts:
        # dp2ep: routed experts sharded on E over the ep ranks (borrowed from dp_shard x cp); data
        # parallel then shards them over what is left (efsdp).
        ep = plan.parallel_modules["ep"]
        overlap = info.get("expert_overlap")
        dispatchers = ep.apply_expert_parallel(
            module, meshes.ep, part.experts, ep_config(ep, config), tp_mesh=meshes.tp, ep_etp_mesh=meshes.ep_etp,
            overlap_modules=None if overlap is None else {k: v for k, v in overlap.items() if k in part.experts},
        )
    apply_activation_checkpointing(
        module, part.blocks, config.training.activation_checkpoint, config.training.activation_checkpoint_every
    )
    if config.training.compile:
        for path in part.blocks:
            module.get_submodule(path).compile(**compile_kwargs(config.training))
        if dims.tp == 1 and loss_head_of(module) is not None:
            loss_head_of(module).compile_loss()
    wrapped = apply_data_parallel(
        module, meshes, part.blocks, dp_config, expert_modules=part.experts,
        edge_units=part.edge_units if dp_mode in ("fsdp", "hsdp") else (),
    )  # fmt: skip
    if dims.tp > 1 and dp_mode in ("fsdp", "hsdp"):
        fsdp_post_forward_first(module)  # no "returned a view tensor" warning (fsdp_tp.py)
    if not plan.full_init:
        _init(module, device, config.job.seed)
    return loss_parallel, cp_layout, dispatchers, wrapped


def _autocast(config: Config, meshes: Meshes, dp_config, dp_mode: str, device: torch.device):
    """For forward + loss, or None: where no sharding policy casts the parameters to bf16."""
    from plait.dataparallel import autocast_context

    dtype = _dtype(config)
    if dtype == torch.float32:
        return None
    if meshes.dims.world_size == 1:
        return autocast_context(meshes, dp_config, device.type)
    if dp_mode == "none":  # tensor (or pipeline) parallel alone: autocast, as the one-rank run does
        return torch.autocast(device.type, dtype=dtype)
    return None
