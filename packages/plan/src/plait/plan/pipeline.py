"""The pipeline side of the plan: rank 0's stages, one micro-batch each, and torch's own order.

torch's schedule cannot run under the fake process group (its shape inference sends Python
objects point to point), and a step of m micro-batches would trace m times the work. So:

- the stages are the trainer's (`parallelize` -> `parallelize_pipeline`) and the schedule is the
  trainer's (`build_trainer_pipeline`: torch's PipelineStage and schedule objects, which only
  compute their action lists when built);
- each stage this rank holds runs a micro-batch (pipeline_microbatch_size rows) forward and
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

import contextlib
import dataclasses
from collections import Counter

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.tensor import DTensor

from plait.models.documents import row_segments
from plait.trainer.validate import pipeline_microbatches

from .pipeline_order import BUBBLE, StageMemory, p2p_actions, unshard_counts, walk_memory

AGAIN = "again"  # a stage's second micro-batch: adds to the gradients the first one made
PLAN_ONLY = "plan_only"  # what the plan makes in place of a receive: no op of the run


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


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def _boundary(out) -> dict:
    """What a stage sends: its output's local shape and dtype (and DTensor layout), no storage."""
    local = _local(out)
    spec = {"shape": tuple(local.shape), "dtype": local.dtype, "bytes": local.numel() * local.element_size()}
    if isinstance(out, DTensor):
        spec.update(mesh=out.device_mesh, placements=out.placements, global_shape=out.shape, stride=out.stride())
    return spec


def _received(spec: dict, device):
    """The activation a stage receives (torch's recv buffer, made to require grad)."""
    buffer = torch.zeros(spec["shape"], dtype=spec["dtype"], device=device)
    if "mesh" in spec:
        return DTensor.from_local(buffer, spec["mesh"], spec["placements"], shape=spec["global_shape"],
                                  stride=spec["stride"], run_check=False).requires_grad_(True)
    return buffer.requires_grad_(True)


def trace_pipeline_step(config, plan, meshes, device, shims, documents_per_row: int = 1):
    """Rank 0's pipeline step (see the module docstring), inside the caller's fake world and
    FakeTensorMode (plan/trace.py). Returns a StepTrace with its `pipeline` facts."""
    from torch.distributed._tools.mem_tracker import _TOTAL_KEY

    from plait.trainer.pipeline import build_trainer_pipeline

    from .collectives import CollectiveCounter, axis_names
    from .host_ops import HostOpCounter
    from .traced_step import (
        FIRST_OPTIMIZER_STEP,
        MICRO,
        STEP,
        PeakTracker,
        StepTrace,
        _local_bytes,
        _storage_total,
        build_traced_trainer,
        micro_batch,
        steady_optimizer_ops,
    )

    t, p = config.training, config.parallelism
    plan = traceable_plan(plan)
    trainer = build_traced_trainer(config, plan, meshes, device, shims)
    pm, optimizer = trainer.pm, trainer.optimizer
    pipeline = build_trainer_pipeline(config, plan, meshes, pm, trainer.loss_fn, trainer.moe, device)
    trainer.pipeline = pipeline
    schedule, n_mb = pipeline.schedule, pipeline_microbatches(config)
    stages = pipeline.stages

    # The local batch (accumulation micro-batches merged, as the trainer does), then one micro-batch of it.
    with unset_fake_temporarily():
        tokens, labels, documents = micro_batch(dataclasses.replace(
            config, training=dataclasses.replace(t, local_batch_size=t.local_batch_size * t.gradient_accumulation_steps)),
            documents_per_row=documents_per_row)
    inputs_BS, labels_BS, positions, documents_BS = trainer.local_batch(tokens, labels, documents)
    rows = p.pipeline_microbatch_size
    kwargs = {}
    if positions is not None:
        kwargs["positions"] = (positions.unsqueeze(0).expand(inputs_BS.shape[0], -1) if positions.dim() == 1
                               else positions)[:rows]
    if documents_BS is not None:
        kwargs["document_positions"] = documents_BS[:rows]
        with unset_fake_temporarily():
            row_segments(kwargs["document_positions"])

    counter = CollectiveCounter(axis_names(meshes))
    ops = HostOpCounter(STEP)
    ops.skip.update({FIRST_OPTIMIZER_STEP, PLAN_ONLY})
    tracker = PeakTracker()
    tracker.track_external(pm.inner, optimizer)
    unshards = unshard_counts(schedule)
    stage_memory: dict[int, StageMemory] = {}
    boundary, logits_bytes, base = None, 0, 0
    dispatchers = list((pm.dispatchers or {}).values())

    def current() -> int:
        return sum(snap[_TOTAL_KEY] for snap in tracker._curr_mem_snap.values())

    def segment_peak(start: int) -> tuple[int, str]:
        return max(tracker._peak_mem.values(), default=start) - start, tracker.peak_where[0]

    autocast = pm.autocast or contextlib.nullcontext()

    def host_syncs() -> int:
        return sum(getattr(d, "host_syncs", 0) for d in dispatchers)

    def run_micro_batch(stage, torch_stage) -> dict:
        """One micro-batch forward and backward of `stage`, as torch's stage runs it; bytes
        relative to the memory before its forward."""
        nonlocal boundary, logits_bytes
        if stage.is_first:
            x, inputs = inputs_BS[:rows], ()
        else:  # the receive buffer is torch's, allocated once (counted apart): not the micro-batch's
            with ops.in_phase(PLAN_ONLY):
                x = _received(boundary, device)
            inputs = (x,)
        before = current()
        tracker._peak_mem = {}
        with trainer.loss_context(), autocast:
            out = stage.module(x, **kwargs)
            target = pipeline.loss(out, labels_BS[:rows]) if stage.is_last else out
        forward, forward_where = segment_peak(before)
        saved = current() - before
        if stage.is_first and not stage.is_last:
            boundary = _boundary(out)
        if stage.is_last:
            logits_bytes = _nbytes(out)
        tracker._peak_mem = {}
        with ops.in_phase(PLAN_ONLY):  # received from the next stage in a run
            grads = None if stage.is_last else torch.ones_like(out)
        with trainer.loss_context():
            torch_stage.backward_maybe_with_nosync(
                "full", {"stage_output": target, "output_grads": grads, "input_values": list(inputs)})
        backward, backward_where = segment_peak(before)
        del inputs, out, target, grads
        if not stage.is_first:
            x.grad = None  # sent to the previous stage and dropped
        return {"saved": saved, "forward": forward, "backward": backward, "grown": current() - before,
                "forward_where": forward_where, "backward_where": backward_where}

    with steady_optimizer_ops(ops, optimizer), tracker, counter, ops:
        counter.phase = STEP
        pipeline.loss.scale = trainer._loss_scale([labels_BS])
        sharded = current()
        for stage in stages:  # torch's UNSHARD (runtime schedules) or the first forward's gather
            counter.phase = ops.phase = f"unshard:{stage.index}"
            for module in _fsdp_modules(stage.module):
                module.unshard()
        counter.phase = MICRO
        base = current()
        gathered = base - sharded  # every unit of this rank's stages, gathered for the whole step
        base_parts = _storage_total(tracker.get_tracker_snapshot("current"))
        syncs = reads = 0
        for stage, torch_stage in zip(stages, pipeline.pipeline_stages):
            # Twice: the first backward creates the stage's gradients, a later one adds to them (the
            # second micro-batch's collectives are not counted: every micro-batch repeats the first's).
            counter.phase, syncs_at, reads_at = MICRO, host_syncs(), shims.reads
            ops.phase = MICRO
            first = run_micro_batch(stage, torch_stage)
            syncs, reads = syncs + host_syncs() - syncs_at, reads + shims.reads - reads_at
            counter.phase = ops.phase = AGAIN
            later = run_micro_batch(stage, torch_stage)
            stage_memory[stage.index] = StageMemory(first["saved"], first["forward"], first["backward"],
                                                    first["grown"], later["forward"], later["backward"],
                                                    first["forward_where"], later["backward_where"])
        counter.phase = ops.phase = STEP
        tracker._peak_mem = {}
        for torch_stage in pipeline.pipeline_stages:
            torch_stage.perform_reduce_grad(1)  # scale_grads = False: the loss carries the scale
        for stage in stages:
            for module in _fsdp_modules(stage.module):
                module.reshard()
        reduce_peak = max(tracker._peak_mem.values(), default=0)
        reduce_parts = _storage_total(tracker.get_tracker_snapshot("peak"))
        tracker._peak_mem = {}
        step_loss = torch.zeros((), device=device)
        dist.all_reduce(step_loss, group=meshes.pp.get_group())
        grads_bytes = _local_bytes(q.grad for q in pm.inner.parameters())
        trainer._update()
        update_peak = max(tracker._peak_mem.values(), default=0)
        update_parts = _storage_total(tracker.get_tracker_snapshot("peak"))

    optimizer_bytes = _local_bytes(v for s in optimizer.state.values() for v in s.values()
                                   if isinstance(v, torch.Tensor) and v.dim() > 0)
    walk = walk_memory(schedule.pipeline_order[0], stage_memory)
    # From the second step on the optimizer state is held through the micro-batches too.
    pipelined_peak = base + optimizer_bytes + walk["bytes"]
    p2p = p2p_actions(schedule, stages)
    boundary_bytes = boundary["bytes"] if boundary is not None else 0
    # torch's stage keeps one receive buffer per micro-batch: activations into a non-first stage,
    # gradients into a non-last one (allocated at the first step, kept).
    buffers = n_mb * boundary_bytes * sum((not s.is_first) + (not s.is_last) for s in stages)
    # After the last micro-batch: torch's REDUCE_GRAD (FSDP's reduce-scatter of the accumulated
    # gradients), then the optimizer step; the state exists through the first from step 2 on.
    reduce_peak += optimizer_bytes
    reduce_parts["Optstate"] = reduce_parts.get("Optstate", 0) + optimizer_bytes
    tail_peak = max(reduce_peak, update_peak)
    tail_where = ("REDUCE_GRAD (the gradients' reduction after the last micro-batch)", "backward") \
        if reduce_peak >= update_peak else ("the optimizer step", "optimizer")
    if pipelined_peak >= tail_peak:
        peak, where, phase = pipelined_peak, walk["where"] or f"stage {walk['stage']}", walk["phase"]
        parts = {k: v for k, v in base_parts.items() if k != "Total"}
        # The gathered units are counted as parameters (the tracker files FSDP's all-gather output
        # under whatever phase made it); held gradients and activations in flight from the walk.
        parts["Activation"] = parts.get("Activation", 0) - gathered + walk["bytes"] - walk["grads"]
        parts["Parameter"] = parts.get("Parameter", 0) + gathered
        parts["Gradient"] = parts.get("Gradient", 0) + walk["grads"]
        parts["Optstate"] = parts.get("Optstate", 0) + optimizer_bytes
    else:
        peak, (where, phase) = tail_peak, tail_where
        parts = {k: v for k, v in (reduce_parts if reduce_peak >= update_peak else update_parts).items()
                 if k != "Total"}
    parts["Pipeline buffers"] = buffers
    repeat = {MICRO: n_mb, **{f"unshard:{s.index}": unshards.get(s.index, 1) for s in stages}}
    collectives = {f"{axis}/{kind}": row for (axis, kind), row in counter.totals(repeat).items()}
    n_p2p = sum(p2p.values())
    # Each stage's first micro-batch once, its second for every later one; a send or receive is one op.
    op_repeat = {MICRO: 1, AGAIN: n_mb - 1, **{f"unshard:{s.index}": unshards.get(s.index, 1) for s in stages}}
    if n_p2p:
        ranks = dist.get_process_group_ranks(meshes.pp.get_group())
        collectives["pp/send_recv"] = {"bytes": n_p2p * boundary_bytes, "count": n_p2p, "ranks": 2,
                                       "span": ranks[1] - ranks[0] + 1}
    saved_peak = sum(m.saved for m in stage_memory.values())
    pp, v = meshes.dims.pp, len(stages)
    formula, bubble = BUBBLE[type(schedule).__name__.removeprefix("Schedule")]
    return StepTrace(
        params=_local_bytes(pm.inner.parameters()),
        grads=grads_bytes,
        optimizer=optimizer_bytes,
        activations=walk["max_in_flight"] * max(m.saved for m in stage_memory.values()) if stage_memory else 0,
        logits=logits_bytes,
        peak=peak + buffers,
        peak_module=where,
        peak_phase=phase,
        peak_parts=parts,
        collectives=dict(sorted(collectives.items())),
        micro_batch_tokens=rows * t.seq_len,
        host_syncs=syncs * n_mb,
        host_reads=reads * n_mb,
        host_ops=ops.ops(op_repeat) + n_p2p,
        host_kernel_ops=ops.kernel_ops(op_repeat) + n_p2p,
        host_ops_by_op=dict((ops.by_op(op_repeat) + Counter({"c10d::send": p2p["SEND_F"] + p2p["SEND_B"],
                                                             "c10d::recv_": p2p["RECV_F"] + p2p["RECV_B"]})).most_common()),
        pipeline={
            "schedule": type(schedule).__name__.removeprefix("Schedule"),
            "stages": [s.index for s in stages],
            "num_stages": stages[0].num_stages,
            "blocks": sum(len(s.blocks) for s in stages),  # of the model's (FLOPs share)
            "model_blocks": len(plan.info["blocks"]),
            "gathered": gathered,
            "microbatches": n_mb,
            "microbatch_rows": rows,
            "max_in_flight": walk["max_in_flight"],
            "in_flight_at_peak": walk["in_flight_at_peak"],
            "saved_per_microbatch": {s: m.saved for s, m in stage_memory.items()},
            "saved_all_stages_one_microbatch": saved_peak,
            "boundary": {"shape": list(boundary["shape"]), "dtype": str(boundary["dtype"]).removeprefix("torch."),
                         "bytes": boundary_bytes} if boundary is not None else None,
            "p2p": p2p,
            "recv_buffers": buffers,
            "stage_peak": pipelined_peak,
            "optimizer_step_peak": tail_peak,
            "bubble": bubble(pp, v, n_mb),
            "bubble_formula": formula,
        },
    )
