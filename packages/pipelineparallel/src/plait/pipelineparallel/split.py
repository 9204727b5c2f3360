"""Cut a model into pipeline stages from plain data: `parallel_info()["blocks"]` and `["edge_units"]`.

A stage is a copy of the whole model with the blocks of other stages deleted and the edge units it
does not hold set to None, so its module paths (and so its state-dict keys) are the unsplit
model's. plait models keep blocks in a ModuleDict `layers` keyed "0".."n-1" and skip a None
embedding (the stage then receives hidden states), norm or output head; nothing here knows the
model's class.

Stage placement follows torch's schedules: "loop" puts stage s on rank s % pp (rank r holds r,
r + pp, ...), "v" puts stages r and 2pp-1-r on rank r (ZBVZeroBubble, DualPipeV).
"""

import copy
from dataclasses import dataclass, field

from torch import nn

from .config import LAYERS_KEY, PipelineConfigError


@dataclass
class Stage:
    """One pipeline stage this rank holds."""

    index: int  # 0 .. num_stages-1, in forward order
    num_stages: int
    module: nn.Module  # the pruned copy (split_stages) or a UserModelStage (split_user_model)
    blocks: list[str] = field(default_factory=list)  # its blocks' module paths (FSDP / AC / compile units)
    edge_units: list[list[str]] = field(default_factory=list)  # the edge-unit groups it holds

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.num_stages - 1


def stage_layer_counts(n_blocks: int, num_stages: int, layers_per_stage: list[int] | None = None) -> list[int]:
    """Blocks per stage: `layers_per_stage` as given, or an even split (validate_pipeline_parallel checks)."""
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        if len(counts) != num_stages or sum(counts) != n_blocks:
            raise PipelineConfigError(
                f"{LAYERS_KEY} = {counts} must have {num_stages} entries summing to {n_blocks} blocks."
            )
        return counts
    if n_blocks % num_stages:
        raise PipelineConfigError(
            f"{num_stages} stages do not divide {n_blocks} blocks: set {LAYERS_KEY} (one count per stage)."
        )
    return [n_blocks // num_stages] * num_stages


def stage_indices(pp_rank: int, pp_degree: int, virtual_stages: int = 1, style: str = "loop") -> list[int]:
    """The stages rank `pp_rank` holds, in the order torch's schedules expect them."""
    if style == "loop":
        return [pp_rank + k * pp_degree for k in range(virtual_stages)]
    if style == "v":
        if virtual_stages != 2:
            raise PipelineConfigError(f"a V schedule places 2 stages per rank, got {virtual_stages}.")
        return [pp_rank, 2 * pp_degree - 1 - pp_rank]
    raise ValueError(f"style must be 'loop' or 'v', got {style!r}")


def stage_blocks(blocks: list[str], counts: list[int]) -> list[list[str]]:
    """Consecutive runs of `blocks`, `counts[s]` of them for stage s."""
    out, start = [], 0
    for count in counts:
        out.append(list(blocks[start : start + count]))
        start += count
    return out


def split_stages(
    model: nn.Module,
    info: dict,
    pp_degree: int,
    pp_rank: int,
    layers_per_stage: list[int] | None = None,
    virtual_stages: int = 1,
    style: str = "loop",
) -> list[Stage]:
    """This rank's stages of `model` (left unmodified), cut at block boundaries.

    The first edge-unit group (the embedding) goes on stage 0 and the last (norm + output head) on
    the last stage. Each stage is a deep copy: build the model on the meta device and materialise
    the stages (`to_empty` + `init_weights`), or pass a real model to copy its weights.
    """
    num_stages = pp_degree * virtual_stages
    blocks = list(info["blocks"])
    _check_paths(model, blocks, info.get("edge_units", []))
    per_stage = stage_blocks(blocks, stage_layer_counts(len(blocks), num_stages, layers_per_stage))
    edges = [list(group) for group in info.get("edge_units", [])]
    first_edges, last_edges = (edges[:1], edges[-1:]) if len(edges) >= 2 else (edges, [])
    stages = []
    for index in stage_indices(pp_rank, pp_degree, virtual_stages, style):
        held_edges = (first_edges if index == 0 else []) + (last_edges if index == num_stages - 1 else [])
        module = copy.deepcopy(model)
        kept = set(per_stage[index])
        for path in blocks:
            if path not in kept:
                _delete(module, path)
        held = {p for group in held_edges for p in group}
        for path in (p for group in edges for p in group):
            if path not in held:
                _set_none(module, path)
        stages.append(Stage(index, num_stages, module, per_stage[index], held_edges))
    return stages


def _check_paths(model: nn.Module, blocks: list[str], edge_units) -> None:
    """Every block and edge-unit path names a submodule of `model`: one line naming the first that
    does not (a typo in a plan of one's own model), before any stage is cut."""
    names = dict(model.named_modules())
    for kind, paths in (("blocks", blocks), ("edge_units", [p for group in edge_units for p in group])):
        for path in paths:
            if path not in names:
                near = [n for n in names if n.rsplit(".", 1)[-1] == path.rsplit(".", 1)[-1]][:3]
                hint = f" (modules with that name: {', '.join(near)})" if near else ""
                raise PipelineConfigError(
                    f"parallel_info()[{kind!r}] names {path!r}, which is not a submodule of "
                    f"{type(model).__name__}{hint}: give the module paths of model.named_modules()."
                )


def _parent(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, name = path.rpartition(".")
    return (module.get_submodule(parent) if parent else module), name


def _delete(module: nn.Module, path: str) -> None:
    parent, name = _parent(module, path)
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        # Deleting from a list renumbers the rest: paths (and checkpoint keys) would shift.
        raise TypeError(f"block {path!r} sits in a {type(parent).__name__}: pipeline parallel needs an nn.ModuleDict.")
    delattr(parent, name)


def _set_none(module: nn.Module, path: str) -> None:
    parent, name = _parent(module, path)
    setattr(parent, name, None)
