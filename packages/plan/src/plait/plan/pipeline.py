"""The pipeline side of the plan: rank 0's stages, one micro-batch each, and torch's own order.

torch's schedule cannot run under the fake process group (its shape inference sends Python
objects point to point), and a step of m micro-batches would trace m times the work. So:

- the stages are the trainer's (`parallelize` -> `parallelize_pipeline`) and the schedule is the
  trainer's (`build_trainer_pipeline`: torch's PipelineStage and schedule objects, which only
  compute their action lists when built);
- each stage this rank holds runs a micro-batch (pipeline_microbatch_size rows; plan/pipeline_stage.py) forward and
  backward as torch's stage does, twice (the first backward creates the stage's gradients, a later
  one adds to them; the first one's collectives are counted): the first stage on tokens, the others on a received hidden
  state shaped like stage 0's traced output; the last computes the loss, the others backpropagate
  a ones-like output gradient through `backward_maybe_with_nosync` (FSDP's no-sync flags), then
  `perform_reduce_grad` and the optimizer step once;
- FSDP: `reshard_after_forward = never` under pp, and torch's runtime unshards each stage before
  its first action (UNSHARD) and reduce-scatters once after the last (REDUCE_GRAD): the gathers are
  traced once per UNSHARD of the lowered order, the micro-batch's own collectives (TP, CP, EP) are
  repeated m times;
- memory, point to point, gathers: read from torch's action order for rank 0 with each stage's
  traced numbers (plan/pipeline_order.py), so the micro-batches in flight are counted from the
  schedule, not from a formula; each transfer is one boundary tensor (stage 0's output, local shape);
- ops (host_ops.py): each stage's first micro-batch once, its second (which adds to the gradients
  the first made) for each of the m - 1 later ones, the gathers per UNSHARD, one op per send or
  receive of the action order, the step's tail once. Not counted: what only the plan does (the
  received activation and the output gradient are made, not received) and the schedule's own
  bookkeeping between actions (splitting the batch into micro-batches, collecting the losses).
"""

import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily

from plait.trainer.validate import pipeline_microbatches

from .collectives import CollectiveCounter, axis_names
from .host_ops import HostOpCounter
from .pipeline_order import BUBBLE, StageMemory, p2p_actions, unshard_counts, walk_memory
from .pipeline_stage import PLAN_ONLY, StageRunner, stage_batch
from .traced_step import (
    FIRST_OPTIMIZER_STEP,
    MICRO,
    STEP,
    PeakTracker,
    StepTrace,
    _local_bytes,
    _storage_total,
    build_traced_trainer,
    optimizer_state_bytes,
    steady_optimizer_ops,
)

AGAIN = "again"  # a stage's second micro-batch: adds to the gradients the first one made


class _SplitOutsideFakeMode:
    """plait.pipelineparallel with `split_stages` run outside FakeTensorMode: it deep-copies the
    meta model, whose copies must stay meta (a fake copy of a meta tensor cannot be made)."""

    def __init__(self, module):
        self._module = module

    def __getattr__(self, name):
        return getattr(self._module, name)

    def split_stages(self, *args, **kwargs):
        with unset_fake_temporarily():
            return self._module.split_stages(*args, **kwargs)


def traceable_plan(plan):
    """The run's plan, with each stage initialised on its own (`full_init` materialises the whole
    model, then moves it back to meta: not possible for fake tensors; the weights' values do not
    matter to a plan)."""
    modules = {**plan.parallel_modules, "pp": _SplitOutsideFakeMode(plan.parallel_modules["pp"])}
    return dataclasses.replace(plan, full_init=False, parallel_modules=modules)


def _fsdp_modules(module):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def trace_pipeline_step(config, plan, meshes, device, shims, documents_per_row: int = 1):
    """Rank 0's pipeline step (see the module docstring), inside the caller's fake world and
    FakeTensorMode (plan/trace.py). Returns a StepTrace with its `pipeline` facts."""
    from plait.trainer.pipeline import build_trainer_pipeline

    plan = traceable_plan(plan)
    trainer = build_traced_trainer(config, plan, meshes, device, shims)
    pipeline = build_trainer_pipeline(config, plan, meshes, trainer.pm, trainer.loss_fn, device)
    trainer.pipeline = pipeline
    batch = stage_batch(config, trainer, documents_per_row)
    counter = CollectiveCounter(axis_names(meshes))
    ops = HostOpCounter(STEP)
    ops.skip.update({FIRST_OPTIMIZER_STEP, PLAN_ONLY})
    tracker = PeakTracker()
    tracker.track_external(trainer.pm.inner, trainer.optimizer)
    runner = StageRunner(trainer, pipeline, batch, device, tracker, ops)
    measured = _trace_step(runner, counter, shims, meshes, device)
    return _step_trace(config, plan, meshes, runner, measured, counter)


@dataclasses.dataclass
class _Measured:
    """What the traced step measured, in bytes: the memory once every stage is gathered, each
    stage's micro-batch, and the step's tail (REDUCE_GRAD, then the optimizer step)."""

    base: int  # every stage gathered, before the first micro-batch
    gathered: int  # every unit of this rank's stages, gathered for the whole step
    base_parts: dict
    stage_memory: dict[int, StageMemory]
    syncs: int  # host syncs and reads of one micro-batch of each stage
    reads: int
    reduce_peak: int
    reduce_parts: dict
    update_peak: int
    update_parts: dict
    grads: int  # the gradients the optimizer step reads


def _trace_step(runner: StageRunner, counter, shims, meshes, device) -> _Measured:
    """The step, under the memory tracker and the collective and op counters: every stage
    gathered, each stage's micro-batch twice, REDUCE_GRAD and the optimizer step."""
    trainer, pipeline, tracker, ops = runner.trainer, runner.pipeline, runner.tracker, runner.ops
    with steady_optimizer_ops(ops, trainer.optimizer), tracker, counter, ops:
        counter.phase = STEP
        pipeline.loss.scale = trainer._loss_scale([runner.batch.labels_BS])
        sharded = runner.current()
        _unshard_stages(pipeline.stages, counter, ops)
        counter.phase = MICRO
        base = runner.current()
        base_parts = _storage_total(tracker.get_tracker_snapshot("current"))
        stage_memory, syncs, reads = _trace_stages(runner, counter, shims)
        counter.phase = ops.phase = STEP
        reduce_peak, reduce_parts = _reduce_grads(pipeline, tracker)
        update_peak, update_parts, grads = _optimizer_step(trainer, tracker, meshes, device)
    return _Measured(base, base - sharded, base_parts, stage_memory, syncs, reads, reduce_peak, reduce_parts,
                     update_peak, update_parts, grads)


def _unshard_stages(stages, counter, ops) -> None:
    for stage in stages:  # torch's UNSHARD (runtime schedules) or the first forward's gather
        counter.phase = ops.phase = f"unshard:{stage.index}"
        for module in _fsdp_modules(stage.module):
            module.unshard()


def _trace_stages(runner: StageRunner, counter, shims) -> tuple[dict[int, StageMemory], int, int]:
    """Each stage's memory, and the host syncs and reads of its first micro-batch (summed)."""
    ops, stage_memory, syncs, reads = runner.ops, {}, 0, 0
    for stage, torch_stage in zip(runner.pipeline.stages, runner.pipeline.pipeline_stages):
        # Twice: the first backward creates the stage's gradients, a later one adds to them (the
        # second micro-batch's collectives are not counted: every micro-batch repeats the first's).
        counter.phase, syncs_at, reads_at = MICRO, runner.host_syncs(), shims.reads
        ops.phase = MICRO
        first = runner.run(stage, torch_stage)
        syncs, reads = syncs + runner.host_syncs() - syncs_at, reads + shims.reads - reads_at
        counter.phase = ops.phase = AGAIN
        later = runner.run(stage, torch_stage)
        stage_memory[stage.index] = StageMemory(first["saved"], first["forward"], first["backward"],
                                                first["grown"], later["forward"], later["backward"],
                                                first["forward_where"], later["backward_where"])
    return stage_memory, syncs, reads


def _reduce_grads(pipeline, tracker: PeakTracker) -> tuple[int, dict]:
    """torch's REDUCE_GRAD of every stage, then FSDP's reshard: its peak and the parts at it."""
    tracker._peak_mem = {}
    for torch_stage in pipeline.pipeline_stages:
        torch_stage.perform_reduce_grad(1)  # scale_grads = False: the loss carries the scale
    for stage in pipeline.stages:
        for module in _fsdp_modules(stage.module):
            module.reshard()
    return max(tracker._peak_mem.values(), default=0), _storage_total(tracker.get_tracker_snapshot("peak"))


def _optimizer_step(trainer, tracker: PeakTracker, meshes, device) -> tuple[int, dict, int]:
    """The step's loss summed over the pp ranks and the optimizer step, as the trainer's pipeline
    step ends: their peak, the parts at it, and the gradients' bytes before it."""
    tracker._peak_mem = {}
    step_loss = torch.zeros((), device=device)
    dist.all_reduce(step_loss, group=meshes.pp.get_group())
    grads = _local_bytes(q.grad for q in trainer.pm.inner.parameters())
    trainer._update()
    return max(tracker._peak_mem.values(), default=0), _storage_total(tracker.get_tracker_snapshot("peak")), grads


@dataclasses.dataclass
class _Peak:
    """The step's peak: the micro-batches' along torch's action order or the tail's, the higher."""

    bytes: int
    where: str
    phase: str
    parts: dict
    stage_peak: int  # the micro-batches' (the walk of the action order)
    tail_peak: int  # REDUCE_GRAD's or the optimizer step's


def _step_peak(m: _Measured, walk: dict, optimizer_bytes: int) -> _Peak:
    """The peak of a step after the first: the micro-batches' or the tail's, the higher."""
    # From the second step on the optimizer state is held through the micro-batches too.
    pipelined_peak = m.base + optimizer_bytes + walk["bytes"]
    # After the last micro-batch: torch's REDUCE_GRAD (FSDP's reduce-scatter of the accumulated
    # gradients), then the optimizer step; the state exists through the first from step 2 on.
    reduce_peak = m.reduce_peak + optimizer_bytes
    reduce_parts = dict(m.reduce_parts)
    reduce_parts["Optstate"] = reduce_parts.get("Optstate", 0) + optimizer_bytes
    tail_peak = max(reduce_peak, m.update_peak)
    if pipelined_peak >= tail_peak:
        return _Peak(pipelined_peak, walk["where"] or f"stage {walk['stage']}", walk["phase"],
                     _walk_parts(m, walk, optimizer_bytes), pipelined_peak, tail_peak)
    if reduce_peak >= m.update_peak:
        where, phase = "REDUCE_GRAD (the gradients' reduction after the last micro-batch)", "backward"
        parts = reduce_parts
    else:
        where, phase, parts = "the optimizer step", "optimizer", m.update_parts
    return _Peak(tail_peak, where, phase, {k: v for k, v in parts.items() if k != "Total"}, pipelined_peak, tail_peak)


def _walk_parts(m: _Measured, walk: dict, optimizer_bytes: int) -> dict:
    """The parts at a peak reached during the micro-batches."""
    parts = {k: v for k, v in m.base_parts.items() if k != "Total"}
    # The gathered units are counted as parameters (the tracker files FSDP's all-gather output
    # under whatever phase made it); held gradients and activations in flight from the walk.
    parts["Activation"] = parts.get("Activation", 0) - m.gathered + walk["bytes"] - walk["grads"]
    parts["Parameter"] = parts.get("Parameter", 0) + m.gathered
    parts["Gradient"] = parts.get("Gradient", 0) + walk["grads"]
    parts["Optstate"] = parts.get("Optstate", 0) + optimizer_bytes
    return parts


def _step_trace(config, plan, meshes, runner: StageRunner, m: _Measured, counter) -> StepTrace:
    """The traced stages composed along torch's action order for rank 0 (the module docstring)."""
    pm, ops, schedule, stages = runner.trainer.pm, runner.ops, runner.pipeline.schedule, runner.pipeline.stages
    n_mb = pipeline_microbatches(config)
    optimizer_bytes = optimizer_state_bytes(runner.trainer.optimizer)
    walk = walk_memory(schedule.pipeline_order[0], m.stage_memory)
    p2p = p2p_actions(schedule, stages)
    boundary_bytes = runner.boundary["bytes"] if runner.boundary is not None else 0
    # torch's stage keeps one receive buffer per micro-batch: activations into a non-first stage,
    # gradients into a non-last one (allocated at the first step, kept).
    buffers = n_mb * boundary_bytes * sum((not s.is_first) + (not s.is_last) for s in stages)
    peak = _step_peak(m, walk, optimizer_bytes)
    peak.parts["Pipeline buffers"] = buffers
    unshards = unshard_counts(schedule)
    unshard_repeat = {f"unshard:{s.index}": unshards.get(s.index, 1) for s in stages}
    collectives = _collectives(counter, {MICRO: n_mb, **unshard_repeat}, p2p, boundary_bytes, meshes)
    n_p2p = sum(p2p.values())
    # Each stage's first micro-batch once, its second for every later one; a send or receive is one op.
    op_repeat = {MICRO: 1, AGAIN: n_mb - 1, **unshard_repeat}
    p2p_ops = Counter({"c10d::send": p2p["SEND_F"] + p2p["SEND_B"], "c10d::recv_": p2p["RECV_F"] + p2p["RECV_B"]})
    return StepTrace(
        params=_local_bytes(pm.inner.parameters()),
        grads=m.grads,
        optimizer=optimizer_bytes,
        activations=walk["max_in_flight"] * max(s.saved for s in m.stage_memory.values()) if m.stage_memory else 0,
        logits=runner.logits_bytes,
        peak=peak.bytes + buffers,
        peak_module=peak.where,
        peak_phase=peak.phase,
        peak_parts=peak.parts,
        collectives=collectives,
        micro_batch_tokens=runner.batch.rows * config.training.seq_len,
        host_syncs=m.syncs * n_mb,
        host_reads=m.reads * n_mb,
        host_ops=ops.ops(op_repeat) + n_p2p,
        host_kernel_ops=ops.kernel_ops(op_repeat) + n_p2p,
        host_ops_by_op=dict((ops.by_op(op_repeat) + p2p_ops).most_common()),
        pipeline=_pipeline_facts(plan, meshes, runner, m, walk, p2p, peak, buffers, n_mb),
    )


def _collectives(counter, repeat: dict, p2p: dict, boundary_bytes: int, meshes) -> dict:
    """The step's collectives per axis and kind, the point to point transfers as pp/send_recv."""
    collectives = {f"{axis}/{kind}": row for (axis, kind), row in counter.totals(repeat).items()}
    n_p2p = sum(p2p.values())
    if n_p2p:
        ranks = dist.get_process_group_ranks(meshes.pp.get_group())
        collectives["pp/send_recv"] = {"bytes": n_p2p * boundary_bytes, "count": n_p2p, "ranks": 2,
                                       "span": ranks[1] - ranks[0] + 1}
    return dict(sorted(collectives.items()))


def _pipeline_facts(plan, meshes, runner: StageRunner, m: _Measured, walk: dict, p2p: dict, peak: _Peak,
                    buffers: int, n_mb: int) -> dict:
    """StepTrace.pipeline: the schedule, this rank's stages, micro-batches in flight, transfers, bubble."""
    schedule, stages, boundary = runner.pipeline.schedule, runner.pipeline.stages, runner.boundary
    name = type(schedule).__name__.removeprefix("Schedule")
    formula, bubble = BUBBLE[name]
    return {
        "schedule": name,
        "stages": [s.index for s in stages],
        "num_stages": stages[0].num_stages,
        "blocks": sum(len(s.blocks) for s in stages),  # of the model's (FLOPs share)
        "model_blocks": len(plan.info["blocks"]),
        "gathered": m.gathered,
        "microbatches": n_mb,
        "microbatch_rows": runner.batch.rows,
        "max_in_flight": walk["max_in_flight"],
        "in_flight_at_peak": walk["in_flight_at_peak"],
        "saved_per_microbatch": {s: sm.saved for s, sm in m.stage_memory.items()},
        "saved_all_stages_one_microbatch": sum(sm.saved for sm in m.stage_memory.values()),
        "boundary": {"shape": list(boundary["shape"]), "dtype": str(boundary["dtype"]).removeprefix("torch."),
                     "bytes": boundary["bytes"]} if boundary is not None else None,
        "p2p": p2p,
        "recv_buffers": buffers,
        "stage_peak": peak.stage_peak,
        "optimizer_step_peak": peak.tail_peak,
        "bubble": bubble(meshes.dims.pp, len(stages), n_mb),
        "bubble_formula": formula,
    }
