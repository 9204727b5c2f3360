"""Pipeline stages cut from a model plait did not write (transformers' Llama, your own), named by module paths.

split.py cuts plait models, whose forward skips a None embedding, norm or head. Another decoder has
the same shape (embedding -> blocks -> final norm -> head) but its forward runs every piece, so here
a stage is a small module of its own, `UserModelStage`. It holds its pieces of the model (the very
same module objects: parameters shared, nothing copied) under their original module paths, so its
state-dict keys are the model's, and its forward runs embedding (first stage) -> blocks -> norm and
head (last stage). What the model's own forward computes between the pieces (rotary cos / sin,
position ids, a mask) comes from two callables the user passes: `context(stage, hidden_BSD,
**model_kwargs)` once per micro-batch and `block_call(block, hidden_BSD, ctx)` per block. The
model's class is never edited; nothing here knows it.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .config import PipelineConfigError
from .split import Stage, stage_blocks, stage_indices, stage_layer_counts


@dataclass(frozen=True)
class ModelParts:
    """Where a decoder's pieces sit, as module paths of the model (`model.named_modules()`)."""

    embedding: str  # token ids [B, S] -> hidden states [B, S, D]; on the first stage
    blocks: str | Sequence[str]  # a ModuleList / ModuleDict / Sequential path, or the blocks' paths in order
    norm: str | None  # the final norm (last stage); None if the model has none
    head: str  # hidden states -> logits [B, S, V]; on the last stage
    shared: Sequence[str] = ()  # parameter-free modules every stage keeps (rotary embeddings)

    def block_paths(self, model: nn.Module) -> list[str]:
        if not isinstance(self.blocks, str):
            return list(self.blocks)
        return [f"{self.blocks}.{name}" for name, _ in model.get_submodule(self.blocks).named_children()]

    @property
    def edge_units(self) -> list[list[str]]:
        """[[embedding], [norm, head]]: what the first and the last stage hold beyond blocks."""
        return [[self.embedding], [p for p in (self.norm, self.head) if p is not None]]

    def parallel_info(self, model: nn.Module) -> dict:
        """The plain data `validate_pipeline_parallel` (and plait-dataparallel) read."""
        return {"blocks": self.block_paths(model), "edge_units": self.edge_units}


def call_with_context(block: nn.Module, hidden_BSD: torch.Tensor, ctx: dict) -> torch.Tensor:
    """The default `block_call`: `block(hidden_BSD, **ctx)`."""
    return block(hidden_BSD, **ctx)


def model_kwargs_as_context(stage: nn.Module, hidden_BSD: torch.Tensor, **model_kwargs) -> dict:
    """The default `context`: the model keyword inputs of `Pipeline.step`, as they are."""
    return model_kwargs


class UserModelStage(nn.Module):
    """One stage's pieces of a user's model, under the model's module paths; runnable by torch's schedules.

    Input: token ids [B, S] on the first stage, hidden states [B, S, D] on the others (plus the
    model keyword inputs of `Pipeline.step`); output: hidden states, or logits [B, S, V] on the last.
    """

    def __init__(
        self,
        model: nn.Module,
        parts: ModelParts,
        blocks: Sequence[str],
        is_first: bool,
        is_last: bool,
        block_call: Callable = call_with_context,
        context: Callable = model_kwargs_as_context,
    ):
        super().__init__()
        self.parts, self.block_paths = parts, list(blocks)
        self.is_first, self.is_last = is_first, is_last
        self.block_call, self.context = block_call, context
        held = [*self.block_paths, *parts.shared]
        held += parts.edge_units[0] if is_first else []
        held += parts.edge_units[1] if is_last else []
        order = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
        for path in sorted(held, key=order.__getitem__):  # the model's order, so its state-dict order
            _attach(self, path, model.get_submodule(path))

    def forward(self, x: torch.Tensor, **model_kwargs) -> torch.Tensor:
        # Modules are looked up by path at each call: activation checkpointing or compile may have
        # replaced a block at its path since the stage was cut.
        hidden_BSD = self.get_submodule(self.parts.embedding)(x) if self.is_first else x
        ctx = self.context(self, hidden_BSD, **model_kwargs)
        for path in self.block_paths:
            hidden_BSD = self.block_call(self.get_submodule(path), hidden_BSD, ctx)
        if not self.is_last:
            return hidden_BSD
        if self.parts.norm is not None:
            hidden_BSD = self.get_submodule(self.parts.norm)(hidden_BSD)
        return self.get_submodule(self.parts.head)(hidden_BSD)


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register `module` at `path` under `root`, with empty containers for the parents on the way."""
    *parents, name = path.split(".")
    for parent in parents:
        if parent not in root._modules:
            root.add_module(parent, nn.Module())
        root = root._modules[parent]
    root.add_module(name, module)


def split_user_model(
    model: nn.Module,
    parts: ModelParts,
    pp_degree: int,
    pp_rank: int,
    layers_per_stage: list[int] | None = None,
    virtual_stages: int = 1,
    style: str = "loop",
    block_call: Callable = call_with_context,
    context: Callable = model_kwargs_as_context,
) -> list[Stage]:
    """This rank's stages of `model` (left unmodified; its modules are shared, not copied).

    Blocks are split as `split_stages` splits them (evenly, or `layers_per_stage`; "loop" or "v"
    placement). Each `Stage.module` is a `UserModelStage`; `Stage.blocks` and `Stage.edge_units`
    are the paths FSDP shards as units (`apply_data_parallel(stage.module, meshes, stage.blocks,
    ..., edge_units=stage.edge_units)`). Raises PipelineConfigError before anything is cut.
    """
    _check_parts(model, parts)
    blocks = parts.block_paths(model)
    num_stages = pp_degree * virtual_stages
    per_stage = stage_blocks(blocks, stage_layer_counts(len(blocks), num_stages, layers_per_stage))
    _check_one_stage_each(model, parts, per_stage)
    stages = []
    for index in stage_indices(pp_rank, pp_degree, virtual_stages, style):
        first, last = index == 0, index == num_stages - 1
        module = UserModelStage(model, parts, per_stage[index], first, last, block_call, context)
        edges = ([parts.edge_units[0]] if first else []) + ([parts.edge_units[1]] if last else [])
        stages.append(Stage(index, num_stages, module, per_stage[index], edges))
    return stages


def _check_parts(model: nn.Module, parts: ModelParts) -> None:
    """Every path names a submodule, the pieces hold every parameter, no parameter is on two stages."""
    names = dict(model.named_modules())
    fields = [("embedding", parts.embedding), ("norm", parts.norm), ("head", parts.head)]
    if isinstance(parts.blocks, str):
        fields.append(("blocks", parts.blocks))
    else:
        fields += [(f"blocks[{i}]", path) for i, path in enumerate(parts.blocks)]
    fields += [(f"shared[{i}]", path) for i, path in enumerate(parts.shared)]
    for field, path in fields:
        if path is not None and path not in names:
            raise PipelineConfigError(
                f"ModelParts.{field} = {path!r} is not a submodule of {type(model).__name__}: give a path of "
                "model.named_modules()."
            )
    for path in parts.shared:
        if next(names[path].parameters(), None) is not None:
            raise PipelineConfigError(
                f"ModelParts.shared names {path!r}, which has parameters: every stage would train its own copy. "
                "Name it as a block or an edge piece instead (shared is for buffers only, like rotary embeddings)."
            )
    held = [parts.embedding, *parts.block_paths(model), *parts.edge_units[1]]
    ids = {id(p) for path in held for p in names[path].parameters()}
    if {id(p) for p in names[parts.head].parameters()} & {id(p) for p in names[parts.embedding].parameters()}:
        raise PipelineConfigError(
            f"ModelParts.head = {parts.head!r} shares its weight with the embedding {parts.embedding!r}, which sits "
            "on the first stage: untie them (e.g. config.tie_word_embeddings = False) or run without pipeline parallel."
        )
    for name, p in model.named_parameters():
        if id(p) not in ids:
            raise PipelineConfigError(
                f"parameter {name!r} is in none of the ModelParts (embedding, blocks, norm, head): no stage would "
                "hold it. Name its module as one of them."
            )


def _check_one_stage_each(model: nn.Module, parts: ModelParts, per_stage: list[list[str]]) -> None:
    """No parameter is held by pieces on two stages (two blocks sharing a weight, a block and the
    head): each stage would train its own copy, and the copies would drift apart silently."""
    owner: dict[int, tuple[int, str]] = {}
    last = len(per_stage) - 1
    for stage, paths in enumerate(per_stage):
        pieces = ([parts.embedding] if stage == 0 else []) + list(paths) + (parts.edge_units[1] if stage == last else [])
        for path in pieces:
            for name, p in model.get_submodule(path).named_parameters():
                first = owner.setdefault(id(p), (stage, f"{path}.{name}"))
                if first[0] != stage:
                    raise PipelineConfigError(
                        f"parameter {first[1]!r} (stage {first[0]}) is also {f'{path}.{name}'!r} on stage {stage}: each stage "
                        "would train its own copy. Keep modules that share a weight in one block (or set "
                        "layers_per_stage so they sit on one stage), or run without pipeline parallel."
                    )
