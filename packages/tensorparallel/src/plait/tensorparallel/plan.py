"""A model's plan strings -> DTensor parallel styles, checked and applied to its modules.

The plan is plain data from `model.parallel_info()["tp_plan"]`: fnmatch patterns over module paths
(`*` matches one path component) -> plan string, applied in dict order. Everything that can be
checked without a collective is checked first: unknown strings, patterns that match nothing,
module types and sizes each style needs, styles outside a TP region, parameters the plan leaves
plain. Only then are parameters distributed.
"""

import inspect
import re
from collections.abc import Callable, Iterable
from fnmatch import fnmatchcase

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from .async_tp import enable_async_tp
from .config import TensorParallelConfig, TensorParallelConfigError, check_async_tp
from .styles import (
    ExpertsTensorParallel,
    HeadNorm,
    RegionColwise,
    RegionInput,
    ReplicateCompute,
    ReplicatedNorm,
    SequenceParallelNorm,
    VocabShardedLossHead,
    hook_replicate_grads,
)

# plan string -> one line of what it does (README and error messages quote these).
PLAN_STRINGS = {
    "colwise": "nn.Linear, out_features sharded; input replicated inside a region, output local shard",
    "rowwise": "nn.Linear, in_features sharded; output reduce-scattered to Shard(1) under SP, else all-reduced",
    "rowwise_partial": "nn.Linear, in_features sharded; output left a partial sum (MoE shared experts)",
    "sequence_parallel": "norm on sequence shards under SP (replicated weights); replicated norm otherwise",
    "embedding_rowwise": "nn.Embedding, vocab sharded; output Shard(1) under SP, else Replicate",
    "output_colwise": "nn.Linear to the vocab, sharded on it; logits kept Shard(-1) under loss parallel",
    "loss_head": "output projection fused with its loss (weight [V, D]), vocab-sharded; per-token losses out",
    "prepare_input": "opens a TP region: first positional input (or the argument named as "
    "prepare_input(name)) Shard(1) (SP) / Replicate -> Replicate",
    "moe_input_output": "opens a TP region like prepare_input (also (name)); output partial sum -> Shard(1) / Replicate",
    "replicate": "replicated weights, redundant compute inside a region (MLA latent path, router)",
    "head_norm": "replicated weights on each local head inside a region (Qwen3 q_norm / k_norm); weight grad summed",
    "experts_tp": "routed grouped experts [E, in, out], hidden dim sharded (runs without expert parallel)",
}

_REGION_OPENERS = ("prepare_input", "moe_input_output")
# Styles whose gradient convention only holds inside a region (see styles.py).
_REGION_ONLY = ("colwise", "rowwise", "rowwise_partial", "replicate", "head_norm", "experts_tp")
# `style` or `style(argument)`: a region opener may name the argument that carries the hidden state.
_PLAN_STRING = re.compile(r"(\w+)(?:\((\w+)\))?")


def parse_plan_string(plan_string: str) -> tuple[str, str | None]:
    """`"prepare_input(hidden_states)"` -> `("prepare_input", "hidden_states")`; `"colwise"` -> `("colwise", None)`.

    Raises for a malformed or unknown string, or an argument on a style that takes none."""
    match = _PLAN_STRING.fullmatch(plan_string) if isinstance(plan_string, str) else None
    if match is None:
        raise TensorParallelConfigError(
            f"malformed tensor-parallel plan string {plan_string!r}: write a style name such as 'colwise', or "
            "a region opener with the name of the argument it converts, e.g. 'prepare_input(hidden_states)'."
        )
    style, argument = match.groups()
    if style not in PLAN_STRINGS:
        raise TensorParallelConfigError(
            f"unknown tensor-parallel plan string {plan_string!r}; known: {', '.join(PLAN_STRINGS)} "
            "(docs/contracts.md)."
        )
    if argument is not None and style not in _REGION_OPENERS:
        raise TensorParallelConfigError(
            f"plan string {plan_string!r}: only {' and '.join(_REGION_OPENERS)} take an argument name "
            f"(the input that opens the region); write {style!r}."
        )
    return style, argument


def build_style(plan_string: str, config: TensorParallelConfig, entry: str = "") -> ParallelStyle:
    """The ParallelStyle for one plan string under `config` (sequence / loss parallel).

    `entry` (the module path) only names the plan entry in errors raised at call time."""
    style, argument = parse_plan_string(plan_string)
    sp, lp = config.sequence_parallel, config.loss_parallel
    stream = Shard(1) if sp else Replicate()  # the residual stream between blocks
    builders: dict[str, Callable[[], ParallelStyle]] = {
        "colwise": RegionColwise,
        "rowwise": lambda: RowwiseParallel(output_layouts=stream),
        "rowwise_partial": lambda: RowwiseParallel(output_layouts=Partial()),
        "sequence_parallel": lambda: SequenceParallelNorm() if sp else ReplicatedNorm(),
        "embedding_rowwise": lambda: RowwiseParallel(input_layouts=Replicate(), output_layouts=stream),
        "output_colwise": lambda: _output_colwise(stream, lp),
        "loss_head": lambda: VocabShardedLossHead(stream),
        "prepare_input": lambda: RegionInput(stream, argument=argument, entry=entry),
        "moe_input_output": lambda: RegionInput(stream, output_layout=stream, argument=argument, entry=entry),
        "replicate": lambda: ReplicateCompute(entry=entry),
        "head_norm": HeadNorm,
        "experts_tp": ExpertsTensorParallel,
    }
    return builders[style]()


def _output_colwise(stream, loss_parallel: bool) -> ParallelStyle:
    return ColwiseParallel(
        input_layouts=stream,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )


def path_matches(pattern: str, path: str) -> bool:
    """fnmatch per path component: `layers.*.attention` matches `layers.3.attention` only."""
    parts, pattern_parts = path.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(fnmatchcase(p, q) for p, q in zip(parts, pattern_parts))


def _under(path: str, root: str) -> bool:
    return root == "" or path == root or path.startswith(root + ".")


def resolve_plan(
    model: nn.Module, plan: dict[str, str], external: Iterable[str] = ()
) -> list[tuple[str, str, nn.Module]]:
    """(module path, plan string, module) in plan order; raises for a pattern matching nothing.

    Modules under an `external` pattern (parallelised by another package) are skipped.
    """
    modules = dict(model.named_modules())
    roots = [root for pattern in external for root in _expand(pattern, modules)]
    resolved, seen = [], {}
    for pattern, plan_string in plan.items():
        parse_plan_string(plan_string)  # raises for a malformed or unknown string
        matches = [path for path in modules if path and path_matches(pattern, path)]
        if not matches:
            raise TensorParallelConfigError(
                f"tensor-parallel plan entry {pattern!r}: {plan_string!r} matches no module of "
                f"{type(model).__name__}. Fix the pattern (fnmatch, '*' = one path component such as a layer "
                "index) or drop the entry."
            )
        for path in matches:
            if any(_under(path, root) for root in roots):
                continue
            if path in seen:
                raise TensorParallelConfigError(
                    f"module {path!r} is matched by two tensor-parallel plan entries ({seen[path]!r} and "
                    f"{pattern!r}); a module takes one plan string."
                )
            seen[path] = pattern
            resolved.append((path, plan_string, modules[path]))
    return resolved


def _expand(pattern: str, modules: dict) -> list[str]:
    return [path for path in modules if path and path_matches(pattern, path)]


def check_plan(model: nn.Module, resolved: list, tp: int, external: Iterable[str] = ()) -> None:
    """Structural checks of the resolved plan against tp, before any collective."""
    regions = [path for path, s, _ in resolved if parse_plan_string(s)[0] in _REGION_OPENERS]
    for path, plan_string, module in resolved:
        _check_module(path, plan_string, module, tp)
        region = next((r for r in regions if _under(path, r) and path != r), None)
        if plan_string == "sequence_parallel" and region is not None:
            raise TensorParallelConfigError(
                f"plan entry {path!r}: 'sequence_parallel' is for norms on the residual stream between blocks, "
                f"but {path!r} sits inside the region {region!r}; mark it 'head_norm' if it acts on each local "
                "head (a colwise output, e.g. q_norm / k_norm), 'replicate' if on an activation every rank holds whole."
            )
        if parse_plan_string(plan_string)[0] in _REGION_ONLY and region is None:
            raise TensorParallelConfigError(
                f"plan entry {path!r}: {plan_string!r} must sit inside a module marked 'prepare_input' or "
                "'moe_input_output' (that module converts the block's hidden state and reduces the partial "
                f"gradients of everything inside it once). Mark an ancestor of {path!r} as one of them."
            )
    _check_coverage(model, resolved, external)


def _check_module(path: str, plan_string: str, module: nn.Module, tp: int) -> None:
    def need(cls: type, why: str) -> None:
        if not isinstance(module, cls):
            raise TensorParallelConfigError(
                f"plan entry {path!r}: {plan_string!r} needs an {cls.__module__.split('.')[0]}.nn.{cls.__name__} "
                f"({why}), got {type(module).__name__}."
            )

    def divisible(size: int, what: str) -> None:
        if size % tp:
            raise TensorParallelConfigError(
                f"plan entry {path!r}: {plan_string!r} shards {what} = {size} over parallelism.tp = {tp}, which "
                f"does not divide it. Use a tp that divides {size}, or change the model's size."
            )

    argument = parse_plan_string(plan_string)[1]
    if argument is not None:
        _check_argument(path, plan_string, module, argument)
    if plan_string in ("colwise", "output_colwise"):
        need(nn.Linear, "its output features are sharded")
        divisible(module.out_features, "out_features")
    elif plan_string in ("rowwise", "rowwise_partial"):
        need(nn.Linear, "its input features are sharded")
        divisible(module.in_features, "in_features")
    elif plan_string == "loss_head":
        w = getattr(module, "weight", None)
        if not isinstance(w, nn.Parameter) or w.ndim != 2:
            raise TensorParallelConfigError(
                f"plan entry {path!r}: 'loss_head' needs a module with a 2-D `weight` [vocab, dim], got "
                f"{type(module).__name__}."
            )
        divisible(w.shape[0], "the vocabulary (weight.shape[0])")
    elif plan_string == "embedding_rowwise":
        need(nn.Embedding, "its vocabulary rows are sharded")
        divisible(module.num_embeddings, "num_embeddings (vocab size)")
    elif plan_string == "experts_tp":
        for name, dim in ExpertsTensorParallel.HIDDEN_DIM.items():
            w = getattr(module, name, None)
            if not isinstance(w, nn.Parameter) or w.ndim != 3:
                raise TensorParallelConfigError(
                    f"plan entry {path!r}: 'experts_tp' needs grouped experts with 3-D parameters w1, w2, w3 "
                    f"([E, in, out]); {name} is {None if w is None else tuple(w.shape)}."
                )
            divisible(w.shape[dim], f"the expert hidden dim ({name}.shape[{dim}])")


def _check_argument(path: str, plan_string: str, module: nn.Module, argument: str) -> None:
    """The named argument must be one `forward` can receive (by name, or through its **kwargs)."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):  # no introspectable signature: checked when called
        return
    if argument in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    raise TensorParallelConfigError(
        f"plan entry {path!r}: {plan_string!r} names argument {argument!r}, which "
        f"{type(module).__name__}.forward does not take (it takes {', '.join(params) or 'nothing'}). "
        "Name the argument that carries the hidden state."
    )


def _check_coverage(model: nn.Module, resolved: list, external: Iterable[str]) -> None:
    """Every parameter must end up on the tp mesh (or be left to another package)."""
    covered = [path for path, s, _ in resolved if parse_plan_string(s)[0] not in _REGION_OPENERS]
    modules = dict(model.named_modules())
    skipped = [e for p in external for e in _expand(p, modules)]
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            continue
        owner = name.rpartition(".")[0]
        if any(_under(owner, c) for c in covered) or any(_under(owner, e) for e in skipped):
            continue
        raise TensorParallelConfigError(
            f"parameter {name!r} is not covered by the tensor-parallel plan: under TP its gradient would be "
            f"wrong (a partial sum) or it would sit off the tp mesh. Add a plan entry for {owner!r} "
            "('replicate' for weights every TP rank uses whole, 'head_norm' for a norm on each local head, or a "
            "sharding style), or list it in "
            "TensorParallelConfig.external_modules if another package parallelises it."
        )


def apply_tensor_parallel(
    model: nn.Module, tp_mesh: DeviceMesh | None, plan: dict[str, str], config: TensorParallelConfig
) -> nn.Module:
    """Shard `model` over `tp_mesh` as `plan` says; returns the model (modified in place).

    A `None` mesh or a mesh of size 1 leaves the model untouched. Works on a model built on the
    meta device (then materialise and `init_weights()`) or on real full weights, which are then
    distributed as they are (rank 0's copy is scattered / broadcast).
    """
    if tp_mesh is None or tp_mesh.size() == 1:
        return model
    if tp_mesh.ndim != 1:
        raise ValueError(f"apply_tensor_parallel needs a 1-D tp mesh, got a {tp_mesh.ndim}-D mesh {tp_mesh}.")
    tp = tp_mesh.size()
    resolved = resolve_plan(model, plan, config.external_modules)
    check_plan(model, resolved, tp, config.external_modules)
    if config.async_tp:
        check_async_tp(tp, config)
    ties = _tied_parameters(model)
    for path, plan_string, module in resolved:
        parallelize_module(module, tp_mesh, build_style(plan_string, config, entry=path))
    _retie(model, ties)
    _keep_norm_grad_hooks(model)
    if config.async_tp:
        enable_async_tp(tp_mesh)
    return model


def _keep_norm_grad_hooks(model: nn.Module) -> None:
    """Sequence-parallel norms reduce their weight gradients through hooks on the Parameter
    objects; a meta-device build's `to_empty` replaces those. The root's forward pre-hook hooks
    whatever parameters the norms hold at each forward (a flag check once hooked; the root is not
    compiled per block, so this stays out of compiled regions)."""
    norms = [m for m in model.modules() if getattr(m, "_plait_replicates_grads", False)]
    if not norms:
        return

    def hook_norms(root: nn.Module, args) -> None:
        for norm in norms:
            hook_replicate_grads(norm)

    model.register_forward_pre_hook(hook_norms)


def uses_loss_parallel(plan: dict[str, str], config: TensorParallelConfig, tp: int) -> bool:
    """True when the model will return vocab-sharded DTensor logits (wrap the loss in loss_parallel)."""
    return tp > 1 and config.loss_parallel and "output_colwise" in plan.values()


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """Groups of (module, param name) sharing one Parameter (e.g. tied embedding and output)."""
    by_id: dict[int, list] = {}
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            by_id.setdefault(id(param), []).append((module, name))
    return [group for group in by_id.values() if len(group) > 1]


def _retie(model: nn.Module, ties: list) -> None:
    # Each style distributes its own module's parameter, which unties a shared one; re-share the
    # first copy if every user sharded it the same way (embedding rows == output rows: Shard(0)).
    for group in ties:
        params = [getattr(m, n) for m, n in group]
        first = params[0]
        specs = {(tuple(p.placements) if isinstance(p, DTensor) else None) for p in params}
        if len(specs) != 1:
            names = [n for _, n in group]
            raise TensorParallelConfigError(
                f"tied parameters {names} are sharded differently by the tensor-parallel plan ({specs}); "
                "tied weights need the same layout (embedding_rowwise with output_colwise both shard the vocab)."
            )
        for module, name in group[1:]:
            setattr(module, name, first)
