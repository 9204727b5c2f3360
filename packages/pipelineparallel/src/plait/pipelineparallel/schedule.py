"""torch's pipeline schedules over this rank's stages, with the loss normalised as the caller says.

Gradients must equal the unpipelined run's, where the trainer backpropagates
`sum(token losses) * scale` (scale = dp_cp ranks / global valid tokens). torch's schedules call
`loss_fn(output, target)` once per micro-batch and, by default, divide gradients by the number of
micro-batches; here `scale_grads=False` and the loss is the micro-batch's summed token loss times
the step's `scale`, so the per-micro-batch gradients add up to exactly the unpipelined gradient.

Model keyword inputs (positions, document_positions) are passed on every rank and split along the
batch dimension with the tokens, so every stage, not only the first, sees its micro-batch's.
Document segments a caller read on the host and cached on its tensor (the plain-data attribute
`_plait_document_segments`, one tuple per row; docs/contracts.md) follow the rows into the
micro-batches, so no stage reads them back from the device.

A loss term a stage's layers make (MoE sequence-wise balance losses) must train inside its own
layers' backward, tied into their outputs (plait.models' routers do so): only the last stage's
loss reaches the schedule.
"""

import contextlib
from collections.abc import Callable

import torch
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import get_schedule_class

from .config import SCHEDULES, schedule_name
from .split import Stage

# Per-row document segments cached on a document-positions tensor (plain data, docs/contracts.md).
SEGMENTS_ATTR = "_plait_document_segments"


class ScaledLoss:
    """`loss_fn(output, target) * scale`; the caller sets `scale` before each step."""

    def __init__(self, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]):
        self.loss_fn = loss_fn
        self.scale: torch.Tensor | float = 1.0

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(output, target) * self.scale


class Pipeline:
    """This rank's stages and the schedule that runs them; `step` is one forward + backward."""

    def __init__(self, stages: list[Stage], schedule, loss: ScaledLoss, n_microbatches: int, pipeline_stages=()):
        self.stages = stages
        self.pipeline_stages = list(pipeline_stages)  # torch's PipelineStage per stage
        self.schedule = schedule
        self.loss = loss
        self.n_microbatches = n_microbatches

    @property
    def modules(self) -> list[torch.nn.Module]:
        """The stage modules (parameters for the optimizer, gradient clipping, checkpoints)."""
        return [s.module for s in self.stages]

    @property
    def has_first_stage(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last_stage(self) -> bool:
        return any(s.is_last for s in self.stages)

    def step(
        self,
        inputs_BS: torch.Tensor,
        labels_BS: torch.Tensor,
        scale: torch.Tensor | float = 1.0,
        **model_kwargs,
    ) -> torch.Tensor | None:
        """Forward and backward of the whole local batch in micro-batches; gradients accumulate.

        Every rank passes the same batch (only the first stage reads the tokens, only the last the
        labels; all read `model_kwargs`). Returns, on the rank holding the last stage, the sum of
        the micro-batches' scaled losses (the unpipelined `loss * scale`), else None.
        """
        return self._run(self.schedule.step, inputs_BS, labels_BS, scale, model_kwargs)

    @torch.no_grad()
    def eval_step(self, inputs_BS, labels_BS, scale=1.0, **model_kwargs) -> torch.Tensor | None:
        """Forward only (validation): the summed scaled loss on the last stage's rank, else None."""
        with _no_local_backward_handoff(self.pipeline_stages):
            return self._run(self.schedule.eval, inputs_BS, labels_BS, scale, model_kwargs)

    def _run(self, run, inputs_BS, labels_BS, scale, model_kwargs):
        self.loss.scale = scale
        kwargs = _batch_kwargs(model_kwargs, inputs_BS.shape[0])
        args = (inputs_BS,) if self.has_first_stage else ()
        target = labels_BS if self.has_last_stage else None
        losses: list[torch.Tensor] = []
        run(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not self.has_last_stage:
            return None
        return torch.stack([loss.detach() for loss in losses]).sum()


def _batch_kwargs(model_kwargs: dict, batch: int) -> dict:
    """Drop None inputs and give `[S]` ones a batch dim, so torch splits all of them on dim 0."""
    out = {}
    for name, value in model_kwargs.items():
        if value is None:
            continue
        if isinstance(value, torch.Tensor) and value.dim() == 1:
            value = value.unsqueeze(0).expand(batch, -1)
        out[name] = value
    return out


def build_pipeline(
    stages: list[Stage],
    pp_group,
    schedule: str,
    n_microbatches: int,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    device: torch.device | str,
) -> Pipeline:
    """torch's schedule `schedule` (by name) over this rank's `stages` on the pp process group.

    `loss_fn(logits, labels)` returns the micro-batch's SUMMED token loss; `Pipeline.step(...,
    scale=...)` multiplies it by the step's normaliser. Call after the stage modules are sharded and
    materialised (FSDP / TP apply to each `stage.module`).
    """
    name = schedule_name(schedule)
    device = torch.device(device)
    pipeline_stages = [PipelineStage(s.module, s.index, s.num_stages, device, group=pp_group) for s in stages]
    loss = ScaledLoss(loss_fn)
    cls = get_schedule_class(name)
    if SCHEDULES[name].multi:
        runner = cls(pipeline_stages, n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    else:
        if len(pipeline_stages) != 1:
            raise ValueError(f"schedule {name} runs one stage per rank, got {len(pipeline_stages)}")
        runner = cls(pipeline_stages[0], n_microbatches=n_microbatches, loss_fn=loss, scale_grads=False)
    _keep_row_attributes(runner)
    _isolate_metadata_inference(runner, [s.module for s in stages])
    return Pipeline(stages, runner, loss, n_microbatches, pipeline_stages)


@contextlib.contextmanager
def _no_local_backward_handoff(pipeline_stages):
    """torch 2.13's eval() still walks a V schedule's backward actions, and where two adjacent
    stages share a rank it hands the (absent) input gradient from one to the other, which asserts
    a backward exists. Forward-only, there is nothing to hand over: make it a no-op meanwhile."""
    for stage in pipeline_stages:
        stage.get_local_bwd_output = lambda mb_index: ()
        stage.set_local_bwd_input = lambda outputs, mb_index: None
    try:
        yield
    finally:
        for stage in pipeline_stages:
            del stage.get_local_bwd_output, stage.set_local_bwd_input


def _keep_row_attributes(runner) -> None:
    """Make the schedule's batch split carry cached per-row segments into each micro-batch.

    torch splits keyword inputs with tensor_split, which makes new tensors without the cache; the
    split is one private method (`_split_inputs`, torch 2.13), wrapped here on this instance only.
    """
    split = runner._split_inputs

    def split_keeping_segments(args, kwargs=None):
        args_split, kwargs_split = split(args, kwargs)
        for name, value in (kwargs or {}).items():
            segments = getattr(value, SEGMENTS_ATTR, None)
            if segments is None:
                continue
            start = 0
            for chunk in kwargs_split:
                rows = chunk[name].shape[0]
                setattr(chunk[name], SEGMENTS_ATTR, tuple(segments[start : start + rows]))
                start += rows
        return args_split, kwargs_split

    runner._split_inputs = split_keeping_segments


def _isolate_metadata_inference(runner, modules: list[torch.nn.Module]) -> None:
    """Make torch's shape inference leave no trace in the stage modules.

    On a schedule's first step (and the first after switching between step and eval), torch 2.13
    runs every stage forward and backward once to learn the shapes: later stages on uninitialised
    tensors. That forward updates buffers (MoE routers' token counters, hence the load-balance
    bias), and custom autograd functions can accumulate weight gradients that torch clears only on
    FSDP modules. Buffers and gradients are restored as they were before it (wrapped on this
    instance only; `_initialize_pp_stages`, torch 2.13).
    """
    initialize = runner._initialize_pp_stages

    def isolated(stages, args, kwargs, target, fwd_initialized, bwd_initialized, *rest, **kw):
        if fwd_initialized and runner._has_backward == bwd_initialized:
            return initialize(stages, args, kwargs, target, fwd_initialized, bwd_initialized, *rest, **kw)
        buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
        grads = [(p, p.grad) for m in modules for p in m.parameters()]
        try:
            return initialize(stages, args, kwargs, target, fwd_initialized, bwd_initialized, *rest, **kw)
        finally:
            with torch.no_grad():
                for buffer, saved in buffers:
                    buffer.copy_(saved)
            for param, grad in grads:
                param.grad = grad

    runner._initialize_pp_stages = isolated
