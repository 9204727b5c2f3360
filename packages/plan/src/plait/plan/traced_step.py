"""What a traced step is made of, shared by the single-program trace (trace.py) and the pipeline
trace (pipeline.py): the memory tracker and the StepTrace it fills, the trainer built for one step
inside a fake world, a micro-batch of zeros, the optimizer's steady-state ops.
"""

import contextlib
import io
from dataclasses import dataclass, field

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker

from plait.models.documents import row_segments

from .host_ops import HostOpCounter, Propagating

MICRO = "micro_batch"  # collectives of one micro-batch's forward + backward (repeat per micro-batch)
STEP = "step"  # once per step: the token count, gradient clipping, the optimizer, MoE bookkeeping
# Ops of a run's first optimizer step, which also creates the optimizer's state: not a step's own
# (steady_optimizer_ops counts the step after it instead).
FIRST_OPTIMIZER_STEP = "first_optimizer_step"


class PeakTracker(MemTracker):
    """MemTracker that also remembers where the peak was reached: the innermost module and
    whether in forward or backward (torch's tracker keeps only per-module peaks), and that skips
    DTensor's shape propagation, which under a fake step reuses the step's own FakeTensorMode
    (torch's tracker would count its placeholders: five times the optimizer state for a fused
    AdamW over DTensor parameters)."""

    def __init__(self):
        super().__init__()
        self.peak_where = ("", "")
        self._propagating = None

    def __enter__(self):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        if self._propagating is None:
            self._propagating = Propagating(ShardingPropagator._fake_mode_lock)
            ShardingPropagator._fake_mode_lock = self._propagating
        return super().__enter__()

    def __exit__(self, *args):
        from torch.distributed.tensor._sharding_prop import ShardingPropagator

        super().__exit__(*args)
        if self._depth == 0 and self._propagating is not None:
            ShardingPropagator._fake_mode_lock = self._propagating.inner
            self._propagating = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating is not None and self._propagating.depth:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module, inputs) -> None:
        # A pipeline stage is a top-level module called once per micro-batch, which torch's tracker
        # refuses ("multiple iterative calls"); its per-module stats start over instead (only the
        # step's totals are read).
        if not self._mod_tracker.is_bw and set(self._mod_tracker.parents) <= {"Global", self._mod_fqn(module)}:
            self.memory_tracking.pop(module, None)
        super()._pre_fw_hook(module, inputs)

    def _mod_fqn(self, module) -> str | None:
        return self._mod_tracker.get_known_fqn(module)

    def _update_peak_stats(self, peak_state) -> None:
        # The step's peak only: torch's version also updates every active module's own peak,
        # walking all tracked modules on every op (quadratic in depth: minutes at 61 layers).
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snapshot)
                parents = [p for p in self._mod_tracker.parents if p != "Global"]
                innermost = max(parents, key=lambda p: p.count(".")) if parents else "(outside any module: the loss)"
                phase = "backward" if self._mod_tracker.is_bw else ("optimizer" if self._in_opt else "forward")
                self.peak_where = (innermost, phase)


@dataclass
class StepTrace:
    """What one traced (or measured) step of rank 0 did."""

    params: int  # bytes of the parameters this rank holds (local shards)
    grads: int  # bytes of their gradients after the step's backward
    optimizer: int  # bytes of the optimizer state after the step
    activations: int  # bytes alive for backward when the loss is computed (the logits included)
    logits: int  # bytes of the logits this rank computes
    peak: int  # highest memory of the step (MemTracker: parameters + gradients + state + activations + temporaries)
    peak_module: str  # the innermost module running at the peak
    peak_phase: str  # forward, backward or optimizer
    peak_parts: dict = field(default_factory=dict)  # MemTracker's categories at the peak
    collectives: dict = field(default_factory=dict)  # (axis, kind) -> {bytes, count, ranks}, per step
    micro_batch_tokens: int = 0
    host_syncs: int = 0  # expert-parallel dispatch syncs of the step (the dispatchers' own count)
    host_reads: int = 0  # scalars a plan had to assume (balanced routing); 0 for a measured step
    host_ops: int = 0  # ops the step dispatches, each at least one kernel launch on a GPU (host_ops.py)
    host_kernel_ops: int = 0  # of them, those that launch a kernel (views and allocations left out)
    host_ops_by_op: dict = field(default_factory=dict)  # "namespace::op" -> calls per step
    pipeline: dict = field(default_factory=dict)  # pp > 1: schedule, micro-batches in flight, p2p (plan/pipeline.py)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        if t is None:
            continue
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (0-dim ones, such as a step count, left out)."""
    return _local_bytes(v for s in optimizer.state.values() for v in s.values()
                        if isinstance(v, torch.Tensor) and v.dim() > 0)


def _storage_total(snapshot: dict) -> dict:
    parts: dict[str, int] = {}
    for per_device in snapshot.values():
        for key, value in per_device.items():
            name = getattr(key, "value", str(key))  # "Parameter", "Activation", ... ("Total")
            parts[name] = parts.get(name, 0) + value
    return parts


def trainer_for_step(config, plan, meshes, pm, optimizer, scheduler, device):
    """plait-train's own StepRunner for one step (no data loader, checkpointer or lock); under pp
    plan/pipeline.py gives it the schedule (`runner.pipeline`)."""
    from plait.trainer.moe_step import MoEStep
    from plait.trainer.step import StepRunner

    moe = MoEStep.for_model(pm.inner, plan.model_args, meshes, pm.dispatchers,
                            whole_model=plan.model if pm.stages else None)  # fmt: skip
    return StepRunner(config, plan, meshes, pm, optimizer, scheduler, device, moe=moe)


def micro_batch(config, seq_len: int | None = None, documents_per_row: int = 1):
    """One [local_batch_size, seq_len] micro-batch: token 0 everywhere, `documents_per_row` documents
    of (nearly) equal length per row (the document positions restart at each one's first token).
    Real CPU tensors (make them outside FakeTensorMode)."""
    t = config.training
    seq_len = seq_len or t.seq_len
    if not 1 <= documents_per_row <= seq_len:
        raise ValueError(f"documents_per_row must be in 1..{seq_len}, got {documents_per_row}")
    tokens_BS = torch.zeros(t.local_batch_size, seq_len, dtype=torch.long)
    starts_S = torch.arange(seq_len) * documents_per_row // seq_len  # each token's document
    first_S = torch.searchsorted(starts_S, starts_S)  # where that document starts
    positions_S = (torch.arange(seq_len) - first_S).to(torch.int32)
    documents_BS = positions_S.expand(t.local_batch_size, seq_len).contiguous()
    # Segments read now, on the host, as the trainer does before a step (a fake step cannot read them).
    row_segments(documents_BS)
    return tokens_BS, tokens_BS.clone(), documents_BS


@contextlib.contextmanager
def steady_optimizer_ops(ops: HostOpCounter, optimizer, phase: str = STEP):
    """Count the optimizer step as a step after the first runs it. A first step also creates the
    optimizer's state (AdamW: three tensors per parameter, once per run): its ops go to
    FIRST_OPTIMIZER_STEP, and on leaving, the optimizer steps once more on the same gradients under
    `phase` (state and parameters move again: call it on a step whose results are not kept, as a
    plan or a measured step)."""
    kept, before = [], []

    def pre(opt, args, kwargs):
        if opt.state:
            return  # state made by an earlier step: this one is a steady step already
        kept.extend((p, p.grad) for group in opt.param_groups for p in group["params"] if p.grad is not None)
        before.append(ops.phase)
        ops.phase = FIRST_OPTIMIZER_STEP

    def post(opt, args, kwargs):
        if before:
            ops.phase = before.pop()

    handles = [optimizer.register_step_pre_hook(pre), optimizer.register_step_post_hook(post)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
    if kept:
        for p, grad in kept:
            p.grad = grad
        # The step itself, without torch's wrapper: its profiler range and hooks ran (and were
        # counted) around the first step already.
        step = getattr(type(optimizer).step, "__wrapped__", None)
        with ops, ops.in_phase(phase):
            step(optimizer) if step is not None else optimizer.step()
        for p, _ in kept:
            p.grad = None


def build_traced_trainer(config, plan, meshes, device, shims):
    """The trainer's own build (parallelize, optimizer, scheduler) inside the caller's fake world
    and FakeTensorMode, as a StepRunner for one step (trainer_for_step)."""
    from plait.trainer.lr_scheduler import build_lr_scheduler
    from plait.trainer.optimizer import build_optimizer
    from plait.trainer.parallelize import parallelize

    # Full or sharded init as the run would; parallelize warns that sharded init on CPU draws
    # equal numbers per shard: true, and irrelevant here.
    shims.initialising = True
    with contextlib.redirect_stdout(io.StringIO()):
        pm = parallelize(config, plan, meshes, device)
    shims.initialising = False
    for dispatcher in (pm.dispatchers or {}).values():
        if hasattr(dispatcher, "ep"):
            shims.balance(dispatcher)
    optimizer = build_optimizer(pm.inner, config.optimizer, device, config.job.seed)
    scheduler = build_lr_scheduler(optimizer, config.training.steps, config.lr_scheduler)
    return trainer_for_step(config, plan, meshes, pm, optimizer, scheduler, device)
