"""Pipeline parallel in plait-train: cut the model into this rank's stages (parallelize.py then
parallelises each stage module on the same path as a whole model), and see the stages as one model
for everything that reads parameters by name (optimizer, checkpoints, gradient clipping, MoE
balancing).

Initial weights: with `full_init` the whole model is materialised and initialised with job.seed
first, then cut, so every stage holds exactly the one-rank model's weights (parity from step 1).
Sharded init (`model.init = sharded`) initialises each stage module on its own: its draws differ
from the one-rank model's (start from a seed checkpoint for parity).
"""

from fnmatch import fnmatchcase

import torch
from torch import nn

from plait.mesh import Meshes

from .config import Config
from .mtp import PipelineMTPLoss, mtp_depths
from .validate import RunPlan


class StageUnion(nn.Module):
    """This rank's stage modules as one module with the unsplit model's FQNs.

    Stage modules keep the whole model's paths (their blocks in a ModuleDict keyed by block index,
    absent edge units None), so the union registers the same submodules under the same names:
    ModuleDicts are merged, every other child and root buffer comes from the stage that holds it.
    Its parameters are exactly this rank's; it is never called (the pipeline runs the stages).
    """

    def __init__(self, modules: list[nn.Module]):
        super().__init__()
        self.stage_modules = modules  # a plain list: not registered, so not part of the FQNs
        # The model's arguments, as the whole model has them (checkpoint markers, HF export).
        self.args = getattr(modules[0], "args", None)
        for module in modules:
            for name, child in module.named_children():
                if isinstance(child, nn.ModuleDict):
                    if name not in self._modules:
                        self.add_module(name, nn.ModuleDict())
                    for key, sub in child.items():
                        self._modules[name][key] = sub
                elif name not in self._modules:
                    self.add_module(name, child)
            for name, buf in module.named_buffers(recurse=False):
                if name not in self._buffers:
                    self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)
            for name, param in module.named_parameters(recurse=False):
                if name not in self._parameters:
                    self.register_parameter(name, param)

    def flops_per_token(self, seq_len: int) -> float:
        return self.stage_modules[0].flops_per_token(seq_len)  # counted from the model's args

    def forward(self, *args, **kwargs):
        raise RuntimeError("a pipeline's stages run through the schedule (Trainer.pipeline), not StageUnion")


def owned(paths, module: nn.Module) -> list[str]:
    """The paths among `paths` that exist in `module` (a stage holds some blocks only)."""
    names = {name for name, _ in module.named_modules()}
    return [p for p in paths if p in names]


def stage_plan(plan: dict, module: nn.Module) -> dict:
    """The tensor-parallel plan entries whose patterns match a module of this stage (a pattern
    matching nothing is an error in plait-tensorparallel; other stages' blocks are absent here)."""
    paths = [name.split(".") for name, _ in module.named_modules() if name]

    def matches(pattern: str) -> bool:
        parts = pattern.split(".")
        return any(len(p) == len(parts) and all(fnmatchcase(a, b) for a, b in zip(p, parts)) for p in paths)

    return {pattern: style for pattern, style in plan.items() if matches(pattern)}


def split_stages(config: Config, plan: RunPlan, meshes: Meshes) -> list:
    """This rank's stages of the (materialised or meta) model; parallelize.py parallelises each
    stage module as it does a whole model. The whole model is a description afterwards."""
    pp_module, p = plan.parallel_modules["pp"], config.parallelism
    stages = pp_module.split_stages(
        plan.model, plan.info, p.pp, meshes.pp_rank, list(p.layers_per_stage) or None, p.pipeline_virtual_stages,
        pp_module.schedule_style(p.pipeline_schedule),
    )
    if plan.full_init:
        plan.model.to_empty(device="meta")  # the stages hold copies
    return stages


def build_trainer_pipeline(config: Config, plan: RunPlan, meshes: Meshes, pm, loss_fn, device):
    """torch's schedule over the stages: `loss_fn` the summed token loss (MoE aux losses train in
    their blocks' backward: StepRunner sets their weight, moe_step.py)."""
    from .validate import pipeline_microbatches

    pp_module = plan.parallel_modules["pp"]
    n_mb = pipeline_microbatches(config)
    depths = mtp_depths(plan.model_args)
    if depths:  # the last stage's loss: the main one and each depth's (mtp.py)
        loss_fn = PipelineMTPLoss(loss_fn, depths, plan.model_args.mtp_loss_scale)
    return pp_module.build_pipeline(
        pm.stages, meshes.pp.get_group(), config.parallelism.pipeline_schedule, n_mb, loss_fn, device
    )


def merge_micro_batches(micro_batches: list[tuple]) -> list[tuple]:
    """The accumulation micro-batches as one local batch (the pipeline splits it into its own
    micro-batches): (inputs, labels, document_positions) concatenated along the batch."""
    if len(micro_batches) == 1:
        return micro_batches
    columns = list(zip(*micro_batches))
    return [tuple(None if col[0] is None else torch.cat(col) for col in columns)]
