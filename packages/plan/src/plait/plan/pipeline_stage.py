"""One micro-batch of a pipeline stage that rank 0 holds, run as torch's stage runs it (plan/pipeline.py):
the batch it reads, the activation a later stage receives and what the first stage sends."""

import contextlib
import dataclasses

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed._tools.mem_tracker import _TOTAL_KEY
from torch.distributed.tensor import DTensor

from plait.models.documents import row_segments

from .host_ops import HostOpCounter
from .traced_step import PeakTracker

PLAN_ONLY = "plan_only"  # what the plan makes in place of a receive: no op of the run


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


@dataclasses.dataclass
class StageBatch:
    """The local batch and what its first micro-batch (`rows` rows) runs with."""

    inputs_BS: torch.Tensor
    labels_BS: torch.Tensor
    kwargs: dict  # positions, document_positions: the micro-batch's rows already
    rows: int


def stage_batch(config, trainer, documents_per_row: int) -> StageBatch:
    """The local batch (accumulation micro-batches merged, as the trainer does), then one micro-batch of it."""
    from .traced_step import micro_batch  # looked up at each call: the tests replace it

    t, p = config.training, config.parallelism
    merged = dataclasses.replace(t, local_batch_size=t.local_batch_size * t.gradient_accumulation_steps)
    with unset_fake_temporarily():
        tokens, labels, documents = micro_batch(dataclasses.replace(config, training=merged),
                                                documents_per_row=documents_per_row)
    inputs_BS, labels_BS, positions, documents_BS, _ = trainer.local_batch(tokens, labels, documents)
    rows = p.pipeline_microbatch_size
    kwargs = {}
    if positions is not None:
        kwargs["positions"] = (positions.unsqueeze(0).expand(inputs_BS.shape[0], -1) if positions.dim() == 1
                               else positions)[:rows]
    if documents_BS is not None:
        kwargs["document_positions"] = documents_BS[:rows]
        with unset_fake_temporarily():
            row_segments(kwargs["document_positions"])
    return StageBatch(inputs_BS, labels_BS, kwargs, rows)


class StageRunner:
    """Runs a stage's micro-batch as torch's stage does, under the step's memory tracker and op
    counter; keeps what the first stage sends (its boundary) and the size of the last one's output."""

    def __init__(self, trainer, pipeline, batch: StageBatch, device, tracker: PeakTracker, ops: HostOpCounter):
        self.trainer, self.pipeline, self.batch, self.device = trainer, pipeline, batch, device
        self.tracker, self.ops = tracker, ops
        self.dispatchers = list((trainer.pm.dispatchers or {}).values())
        self.autocast = trainer.pm.autocast or contextlib.nullcontext()
        self.boundary: dict | None = None
        self.logits_bytes = 0

    def current(self) -> int:
        return sum(snap[_TOTAL_KEY] for snap in self.tracker._curr_mem_snap.values())

    def segment_peak(self, start: int) -> tuple[int, str]:
        return max(self.tracker._peak_mem.values(), default=start) - start, self.tracker.peak_where[0]

    def host_syncs(self) -> int:
        return sum(getattr(d, "host_syncs", 0) for d in self.dispatchers)

    def run(self, stage, torch_stage) -> dict:
        """One micro-batch forward and backward of `stage`, as torch's stage runs it; bytes
        relative to the memory before its forward."""
        rows, tracker, ops = self.batch.rows, self.tracker, self.ops
        if stage.is_first:
            x, inputs = self.batch.inputs_BS[:rows], ()
        else:  # the receive buffer is torch's, allocated once (counted apart): not the micro-batch's
            with ops.in_phase(PLAN_ONLY):
                x = _received(self.boundary, self.device)
            inputs = (x,)
        before = self.current()
        tracker._peak_mem = {}
        with self.trainer.loss_context(), self.autocast:
            out = stage.module(x, **self.batch.kwargs)
            target = self.pipeline.loss(out, self.batch.labels_BS[:rows]) if stage.is_last else out
        forward, forward_where = self.segment_peak(before)
        saved = self.current() - before
        if stage.is_first and not stage.is_last:
            self.boundary = _boundary(out)
        if stage.is_last:
            self.logits_bytes = _nbytes(out)
        tracker._peak_mem = {}
        with ops.in_phase(PLAN_ONLY):  # received from the next stage in a run
            grads = None if stage.is_last else torch.ones_like(out)
        with self.trainer.loss_context():
            torch_stage.backward_maybe_with_nosync(
                "full", {"stage_output": target, "output_grads": grads, "input_values": list(inputs)})
        backward, backward_where = self.segment_peak(before)
        del inputs, out, target, grads
        if not stage.is_first:
            x.grad = None  # sent to the previous stage and dropped
        return {"saved": saved, "forward": forward, "backward": backward, "grown": self.current() - before,
                "forward_where": forward_where, "backward_where": backward_where}
