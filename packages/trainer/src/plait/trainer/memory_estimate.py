"""A per-rank peak-memory estimate made before step 1, so a run that cannot fit stops with one line.

Analytic and approximate (plait-plan traces the real step; this is the start-up check, in
milliseconds and without a trace): it reads the meta model's parameter shapes and
`parallel_info()`, never a flavor table. Per rank it counts

- model state: fp32 master weights + fp32 gradients + AdamW's two moments = 16 bytes per
  parameter element this rank holds (12 with optimizer.state_dtype = bf16: bf16 moments). Non-expert weights are split by tp where the TP plan shards
  them and by FSDP over dp_shard x cp; routed experts over ep x etp x efsdp = dp_shard x cp x tp.
- FSDP's unsharded units: the two largest units (the one computing and the one prefetched) in the
  compute dtype, once FSDP shards (dp_shard x cp > 1).
- activations saved for backward: tokens per rank (local_batch_size x seq_len / cp) times, per
  block, the elements of every Linear's input and output (routed experts: per (token, choice)
  pair, top_k pairs per token) in the compute dtype; TP splits the sharded side, and the other side
  too under sequence parallel. activation_checkpoint = full keeps only each checkpointed block's
  input (plus one block recomputed in backward); selective keeps the matmul outputs.
- the loss: logits [tokens, vocab] in the compute dtype plus their fp32 log-softmax (vocab split
  by tp under loss_parallel), what usually overflows for a big vocabulary; under training.loss =
  chunked, one chunk of them (loss_chunk_tokens tokens; vocab split by tp).

Under pipeline parallel (pp > 1) it counts, for the most loaded pp rank, the blocks and edge units
of that rank's stages only; FSDP gathers those stages whole for the step (reshard_after_forward =
never) and accumulates their unsharded gradients in fp32 until the step's one reduce-scatter; the
activations are those of one micro-batch (pipeline_microbatch_size rows) times the micro-batches
the schedule keeps in flight on that rank (`pp_in_flight`, counted from torch's action orders).

It ignores, so it errs low (it may pass a run that then fails, never refuses one that fits): the
CUDA context and allocator fragmentation, norm and RoPE temporaries, attention workspaces, the
unsharded gradients of a unit in backward, MoE dispatch buffers, the gradient of the logits, and
communication buffers.
"""

import fnmatch
import os
from dataclasses import dataclass

import torch
from torch import nn

from plait.mesh import ParallelDims

from .loss_head import chunk_tokens_for
from .optimizer import MOMENT_BYTES

GIB = 2**30
# TP plan styles that shard a weight over tp ranks (the rest replicate it).
TP_SHARDED = {"colwise", "rowwise", "rowwise_partial", "embedding_rowwise", "output_colwise", "loss_head",
              "experts_tp"}


@dataclass
class MemoryEstimate:
    """Bytes per rank, by part."""

    states: int
    gathered: int
    activations: int
    logits: int

    @property
    def total(self) -> int:
        return self.states + self.gathered + self.activations + self.logits

    def parts(self) -> dict:
        return {"model state": self.states, "FSDP unsharded units": self.gathered,
                "activations": self.activations, "logits": self.logits}


def state_bytes(config) -> int:
    """Model state per parameter element: fp32 master weight, fp32 gradient, AdamW's exp_avg and
    exp_avg_sq in optimizer.state_dtype."""
    return 4 + 4 + MOMENT_BYTES[config.optimizer.state_dtype]


def _tp_style(name: str, tp_plan: dict) -> str | None:
    for pattern, style in tp_plan.items():
        if fnmatch.fnmatchcase(name, pattern):
            return style
    return None


def _expert_owner(name: str, experts: list) -> bool:
    return any(name == e or name.startswith(e + ".") for e in experts)


def _param_elements(model: nn.Module, info: dict, dims: ParallelDims, held_paths=None) -> tuple[float, dict]:
    """Elements this rank holds (sharded), and each parameter's TP-split elements (unsharded over
    FSDP); under pp only the parameters under `held_paths` (this rank's blocks and edge units)."""
    experts, tp_plan = info.get("experts", []), info.get("tp_plan", {})
    held, tp_split = 0.0, {}
    for name, p in model.named_parameters():
        module = name.rsplit(".", 1)[0]
        if held_paths is not None and not any(name.startswith(path + ".") for path in held_paths):
            continue
        if _expert_owner(module, experts):
            # ep x etp x efsdp == dp_shard x cp x tp whether or not ep > 1 (ep = 1: tp, then FSDP);
            # FSDP gathers them over efsdp only, so the unsharded unit holds 1 / (ep x etp) of them.
            tp_split[name] = p.numel() / (dims.ep * dims.etp if dims.ep > 1 else dims.tp)
            held += p.numel() / (dims.dp_shard * dims.cp * dims.tp)
            continue
        split = dims.tp if dims.tp > 1 and _tp_style(module, tp_plan) in TP_SHARDED else 1
        tp_split[name] = p.numel() / split
        held += tp_split[name] / dims.dp_shard_cp
    return held, tp_split


def _largest_units(model: nn.Module, info: dict, tp_split: dict, n: int = 2) -> float:
    """Elements of the n largest FSDP units (blocks, edge units, the root's rest), TP-split."""
    units = [[b] for b in info.get("blocks", [])] + [list(u) for u in info.get("edge_units", [])]
    sizes = [0.0] * len(units)
    rest = 0.0
    for name, numel in tp_split.items():
        for i, prefixes in enumerate(units):
            if any(name.startswith(p + ".") for p in prefixes):
                sizes[i] += numel
                break
        else:
            rest += numel
    return sum(sorted(sizes + [rest], reverse=True)[:n])


def _block_elements_per_token(block: nn.Module, dims: ParallelDims, tp_plan: dict, block_name: str,
                              sequence_parallel: bool, experts: list) -> tuple[float, float]:
    """(all saved elements, matmul outputs only) per token of one block: every Linear's input and
    output; routed experts per (token, choice) pair, top_k pairs per token."""
    sp = dims.tp if dims.tp > 1 and sequence_parallel else 1
    saved = outputs = 0.0
    top_k = max((getattr(m, "top_k", 1) for m in block.modules()), default=1)
    for name, m in block.named_modules():
        full = f"{block_name}.{name}" if name else block_name
        if isinstance(m, nn.Linear):
            style = _tp_style(full, tp_plan) if dims.tp > 1 else None
            d_in, d_out = m.in_features, m.out_features
            if style in ("colwise", "output_colwise", "experts_tp"):
                d_in, d_out = d_in / sp, d_out / dims.tp
            elif style in ("rowwise", "rowwise_partial"):
                d_in, d_out = d_in / dims.tp, d_out / sp
            else:
                d_in, d_out = d_in / sp, d_out / sp
            saved += d_in + d_out
            outputs += d_out
        elif full in experts:
            # w1, w3: [E, dim, hidden]; w2: [E, hidden, dim]. Input and output per (token, choice).
            hidden_split = dims.etp if dims.ep > 1 else dims.tp
            for w, hidden_side in (("w1", 2), ("w2", 1), ("w3", 2)):
                weight = getattr(m, w, None)
                if weight is None or weight.dim() != 3:
                    continue
                sizes = {1: weight.shape[1] / sp, 2: weight.shape[2] / sp}
                sizes[hidden_side] = weight.shape[hidden_side] / hidden_split
                saved += top_k * (sizes[1] + sizes[2])
                outputs += top_k * sizes[2]
    return saved, outputs


def _block_dim(model: nn.Module, block: nn.Module) -> int:
    """The residual width: the embedding's or the first Linear's input features."""
    emb = getattr(model, "tok_embeddings", None)
    if isinstance(emb, nn.Embedding):
        return emb.embedding_dim
    return next(m.in_features for m in block.modules() if isinstance(m, nn.Linear))


def pp_in_flight(schedule: str, pp: int, virtual: int, microbatches: int, pp_rank: int = 0) -> int:
    """Micro-batches whose activations pp rank `pp_rank` holds at once (forwarded, weight gradients
    not yet computed), as counted from torch 2.13's action orders at pp 2 / 4 (plan/pipeline.py
    counts them from the order of the run itself)."""
    p, v, m, r = pp, virtual, microbatches, pp_rank
    n = {"gpipe": m * v, "loopedbfs": m * v, "1f1b": p - r, "interleaved1f1b": (v - 1) * p + 2 * (p - 1 - r) + 1,
         "interleavedzerobubble": v * p, "zbvzerobubble": v * p, "dualpipev": v * p + 1}.get(schedule.lower(), m * v)
    return max(1, min(n, m * v))


def estimate_memory(config, dims: ParallelDims, model: nn.Module, info: dict) -> MemoryEstimate:
    """Per-rank peak bytes of a training step (see the module docstring for what is counted);
    under pp the most loaded pp rank's."""
    if dims.pp == 1:
        return _estimate(config, dims, model, info)
    # plait.pipelineparallel's split (split.py), restated: the trainer's own session runs without it.
    p, t = config.parallelism, config.training
    blocks, edges = list(info["blocks"]), [list(group) for group in info.get("edge_units", [])]
    v, stages = p.pipeline_virtual_stages, dims.pp * p.pipeline_virtual_stages
    counts = list(p.layers_per_stage) or [len(blocks) // stages] * stages
    starts = [sum(counts[:s]) for s in range(stages)]
    microbatches = t.local_batch_size * t.gradient_accumulation_steps // p.pipeline_microbatch_size
    estimates = []
    for rank in range(dims.pp):
        if p.pipeline_schedule.lower() in ("zbvzerobubble", "dualpipev"):
            held = [rank, 2 * dims.pp - 1 - rank]
        else:
            held = [rank + k * dims.pp for k in range(v)]
        paths = [b for s in held for b in blocks[starts[s]:starts[s] + counts[s]]]
        paths += (edges[0] if 0 in held and edges else []) + (edges[-1] if stages - 1 in held and edges else [])
        in_flight = pp_in_flight(p.pipeline_schedule, dims.pp, len(held), microbatches, rank)
        estimates.append(_estimate(config, dims, model, info, paths, in_flight / len(held), stages - 1 in held))
    return max(estimates, key=lambda e: e.total)


def _estimate(config, dims: ParallelDims, model: nn.Module, info: dict, held_paths=None, in_flight: float = 1.0,
              has_head: bool = True) -> MemoryEstimate:
    t = config.training
    act_bytes = 2 if t.dtype == "bfloat16" else 4
    held, tp_split = _param_elements(model, info, dims, held_paths)
    states = held * state_bytes(config)
    if held_paths is None:
        gathered = _largest_units(model, info, tp_split) * act_bytes if dims.fsdp_enabled else 0.0
        tokens = t.local_batch_size * t.seq_len / dims.cp
    else:  # pp: the stages gathered whole, their gradients accumulated unsharded in fp32
        gathered = sum(tp_split.values()) * (act_bytes + 4) if dims.fsdp_enabled else 0.0
        tokens = config.parallelism.pipeline_microbatch_size * t.seq_len / dims.cp
    sp = dims.tp if dims.tp > 1 and config.parallelism.sequence_parallel else 1
    tp_plan, experts = info.get("tp_plan", {}), info.get("experts", [])
    per_block = []
    for i, name in enumerate(info.get("blocks", [])):
        if held_paths is not None and name not in held_paths:
            continue
        block = model.get_submodule(name)
        saved, outputs = _block_elements_per_token(block, dims, tp_plan, name,
                                                   config.parallelism.sequence_parallel, experts)
        dim = _block_dim(model, block) / sp
        checkpointed = t.activation_checkpoint != "none" and i % t.activation_checkpoint_every == 0
        if not checkpointed:
            per_block.append((saved, saved))
        elif t.activation_checkpoint == "full":
            per_block.append((dim, saved))  # keeps its input; recomputes `saved` in backward
        else:
            per_block.append((outputs + dim, outputs + dim))
    kept = sum(k for k, _ in per_block)
    # Full AC: one block's activations are rebuilt at a time in backward, on top of what is kept.
    recompute = max((r - k for k, r in per_block), default=0.0)
    activations = tokens * (kept * in_flight + recompute) * act_bytes

    vocab = getattr(getattr(model, "output", None), "out_features", None) or _vocab(model)
    chunked = t.loss == "chunked"
    if dims.tp > 1 and (config.parallelism.loss_parallel or chunked):  # chunked: vocab-parallel under tp
        vocab /= dims.tp
    if chunked:  # one chunk of logits alive at a time (loss_head.py)
        tokens = min(tokens, chunk_tokens_for(t.loss_chunk_tokens, int(vocab * (dims.tp if dims.tp > 1 else 1))))
    # Under pp: the last stage's one micro-batch (its loss follows its forward), on its rank only.
    logits = tokens * vocab * (act_bytes + 4) if has_head else 0
    return MemoryEstimate(int(states), int(gathered), int(activations), int(logits))


def _vocab(model: nn.Module) -> int:
    emb = getattr(model, "tok_embeddings", None)
    return emb.num_embeddings if isinstance(emb, nn.Embedding) else 0


def device_memory(local_ranks: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, a description): the GPU's total memory (its share where ranks share
    a GPU: comm.backend gloo), or on CPU the available system memory shared by this node's
    `local_ranks` ranks."""
    if torch.cuda.is_available():
        gpus = torch.cuda.device_count()
        index = int(os.environ.get("LOCAL_RANK", 0)) % gpus
        props = torch.cuda.get_device_properties(index)
        sharing = -(-max(1, local_ranks) // gpus)
        if sharing > 1:
            share = props.total_memory // sharing
            return share, f"{share / GIB:.1f} GiB of {props.name}'s {props.total_memory / GIB:.1f} GiB ({sharing} ranks on it)"
        return props.total_memory, f"{props.name}'s {props.total_memory / GIB:.1f} GiB"
    ranks = max(1, local_ranks)
    available = _available_host_memory()
    share = available // ranks
    per = f" ({available / GIB:.1f} GiB / {ranks} ranks on this node)" if ranks > 1 else ""
    return share, f"{share / GIB:.1f} GiB of available host memory{per}"


def _available_host_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_problem(config, dims: ParallelDims, model: nn.Module, info: dict, local_ranks: int = 1) -> str | None:
    """One line when the estimate exceeds the device's memory, else None."""
    est = estimate_memory(config, dims, model, info)
    memory, where = device_memory(local_ranks)
    if est.total <= memory:
        return None
    parts = sorted(est.parts().items(), key=lambda kv: -kv[1])
    biggest = ", ".join(f"{k} {v / GIB:.1f}" for k, v in parts[:3] if v >= 0.05 * GIB)
    fix = _fix(config, dims, est)
    return (f"the estimated peak memory per rank is {est.total / GIB:.1f} GiB ({biggest} GiB) but this rank has "
            f"{where}: {fix}, or set training.memory_check = false if you know it fits.")


def _fix(config, dims: ParallelDims, est: MemoryEstimate) -> str:
    t = config.training
    if est.states >= est.activations + est.logits:
        return (f"shard the model over more ranks (dp_shard x cp = {dims.dp_shard_cp}, tp = {dims.tp}) or use a "
                "smaller model.flavor")
    steps = [f"lower training.local_batch_size ({t.local_batch_size}) or training.seq_len ({t.seq_len})"]
    if t.activation_checkpoint != "full" and est.activations > est.logits:
        steps.append(f"set training.activation_checkpoint = 'full' (now '{t.activation_checkpoint}')")
    if t.loss == "full" and est.logits >= est.activations:
        steps.append("set training.loss = 'chunked'")
    elif dims.tp > 1 and not config.parallelism.loss_parallel and est.logits >= est.activations:
        steps.append("set parallelism.loss_parallel = true")
    steps.append("raise tp / cp")
    return ", ".join(steps[:-1]) + " or " + steps[-1]

