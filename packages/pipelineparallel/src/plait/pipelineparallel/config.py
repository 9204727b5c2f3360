"""Schedules by name and every check a pipeline layout needs, run before any collective.

Names are torch's (`torch.distributed.pipelining.get_schedule_class`), case-insensitive. The rules
below are the ones torch's schedule constructors enforce (plus where the edge units must go), so a
bad layout fails here with the config key and the fix instead of in a schedule's constructor on
some ranks, or in a hang.
"""

from dataclasses import dataclass

# Config keys the messages name (the trainer's [parallelism] section).
PP_KEY = "parallelism.pp"
SCHEDULE_KEY = "parallelism.pipeline_schedule"
MICROBATCH_KEY = "parallelism.pipeline_microbatch_size"
LAYERS_KEY = "parallelism.layers_per_stage"
VIRTUAL_KEY = "parallelism.pipeline_virtual_stages"


class PipelineConfigError(ValueError):
    """A pipeline layout that cannot work; the message names the setting and the fix."""


@dataclass(frozen=True)
class ScheduleKind:
    multi: bool  # several stages per rank (torch's PipelineScheduleMulti) or exactly one
    style: str  # how stages map to ranks: "loop" (s -> s % pp) or "v" (r holds r and 2pp-1-r)
    min_microbatches: str  # "one", "stages per rank group" (pp) or "all stages" (pp x virtual)


SCHEDULES: dict[str, ScheduleKind] = {
    "GPipe": ScheduleKind(multi=False, style="loop", min_microbatches="one"),
    "1F1B": ScheduleKind(multi=False, style="loop", min_microbatches="pp"),
    "Interleaved1F1B": ScheduleKind(multi=True, style="loop", min_microbatches="pp"),
    "LoopedBFS": ScheduleKind(multi=True, style="loop", min_microbatches="one"),
    "InterleavedZeroBubble": ScheduleKind(multi=True, style="loop", min_microbatches="pp"),
    "ZBVZeroBubble": ScheduleKind(multi=True, style="v", min_microbatches="stages"),
    "DualPipeV": ScheduleKind(multi=True, style="v", min_microbatches="stages"),
}


def schedule_name(name: str) -> str:
    """torch's spelling of a schedule name given in any case; unknown names list the valid ones."""
    by_lower = {k.lower(): k for k in SCHEDULES}
    if not isinstance(name, str) or name.lower() not in by_lower:
        raise PipelineConfigError(
            f"{SCHEDULE_KEY} = {name!r} is not a pipeline schedule: use one of {', '.join(SCHEDULES)}."
        )
    return by_lower[name.lower()]


def schedule_style(name: str) -> str:
    """"loop" or "v": how the schedule places a rank's stages (the `style` of split_stages)."""
    return SCHEDULES[schedule_name(name)].style


def n_microbatches(batch_size: int, microbatch_size: int) -> int:
    """Micro-batches per step from the local batch size; the size must divide the batch."""
    if not isinstance(microbatch_size, int) or microbatch_size < 1 or batch_size % microbatch_size:
        raise PipelineConfigError(
            f"{MICROBATCH_KEY} = {microbatch_size!r} must be a positive divisor of the local batch size "
            f"{batch_size}: pick one of {[d for d in range(1, batch_size + 1) if batch_size % d == 0]}."
        )
    return batch_size // microbatch_size


def validate_pipeline_parallel(
    info: dict,
    pp: int,
    schedule: str,
    n_microbatches: int,
    layers_per_stage: list[int] | None = None,
    virtual_stages: int = 1,
) -> None:
    """Check a pipeline layout against the model's plain data (`parallel_info()`), before any collective.

    `layers_per_stage` (optional) lists the blocks of every stage in order, pp x virtual_stages of
    them; without it the blocks are split evenly. Raises PipelineConfigError (one line: the key and
    the fix).
    """
    if not isinstance(pp, int) or isinstance(pp, bool) or pp < 1:
        raise PipelineConfigError(f"{PP_KEY} = {pp!r}: the pipeline degree must be an integer >= 1.")
    if pp == 1:
        return
    name = schedule_name(schedule)
    kind = SCHEDULES[name]
    if not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PipelineConfigError(f"{VIRTUAL_KEY} = {virtual_stages!r}: stages per rank must be an integer >= 1.")
    if not kind.multi and virtual_stages != 1:
        raise PipelineConfigError(
            f"{SCHEDULE_KEY} = {name!r} runs one stage per rank but {VIRTUAL_KEY} = {virtual_stages}: set it to 1, "
            "or use Interleaved1F1B / InterleavedZeroBubble / LoopedBFS (or ZBVZeroBubble / DualPipeV with 2)."
        )
    if kind.style == "v" and virtual_stages != 2:
        raise PipelineConfigError(
            f"{SCHEDULE_KEY} = {name!r} is a V schedule: it needs exactly 2 stages per rank, got {VIRTUAL_KEY} = "
            f"{virtual_stages}. Set it to 2."
        )
    stages = pp * virtual_stages
    _check_microbatches(name, kind, pp, stages, n_microbatches)
    _check_blocks(info, pp, stages, layers_per_stage)
    _check_edges(info)


def _check_microbatches(name: str, kind: ScheduleKind, pp: int, stages: int, n: int) -> None:
    if not isinstance(n, int) or n < 1:
        raise PipelineConfigError(
            f"{MICROBATCH_KEY} gives {n!r} micro-batches per step: make it a divisor of the local batch size."
        )
    need = {"one": 1, "pp": pp, "stages": stages}[kind.min_microbatches]
    if n < need:
        what = f"{PP_KEY} = {pp}" if kind.min_microbatches == "pp" else f"the {stages} stages"
        raise PipelineConfigError(
            f"{SCHEDULE_KEY} = {name!r} needs at least as many micro-batches as {what} ({need}), got {n}: lower "
            f"{MICROBATCH_KEY} (or raise the batch size) so that batch / micro-batch size >= {need}."
        )
    if name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        # torch runs these in rounds of n // pp micro-batches (at least one round).
        rounds = max(1, n // pp)
        if n % rounds:
            raise PipelineConfigError(
                f"{SCHEDULE_KEY} = {name!r} runs micro-batches in rounds of {PP_KEY} = {pp}: {n} micro-batches "
                f"are not a whole number of rounds. Use a multiple of {pp} (adjust {MICROBATCH_KEY})."
            )


def _check_blocks(info: dict, pp: int, stages: int, layers_per_stage: list[int] | None) -> None:
    n_blocks = len(info.get("blocks", ()))
    if layers_per_stage is None:
        if n_blocks % stages:
            raise PipelineConfigError(
                f"{PP_KEY} = {pp} x {VIRTUAL_KEY} = {stages // pp} = {stages} stages do not divide the model's "
                f"{n_blocks} blocks evenly: pick degrees that divide {n_blocks}, or list the blocks of every "
                f"stage in {LAYERS_KEY} (summing to {n_blocks})."
            )
        return
    counts = list(layers_per_stage)
    if len(counts) != stages or any(not isinstance(c, int) or isinstance(c, bool) for c in counts):
        raise PipelineConfigError(
            f"{LAYERS_KEY} = {counts} must list one integer per stage: {PP_KEY} x {VIRTUAL_KEY} = {stages} of them."
        )
    if sum(counts) != n_blocks:
        raise PipelineConfigError(
            f"{LAYERS_KEY} = {counts} sums to {sum(counts)}, but the model has {n_blocks} blocks: make it sum "
            f"to {n_blocks}."
        )
    # The first and last stage also hold the embedding / output head, so they may hold no block;
    # a middle stage without a block would only pass activations on.
    if any(c < 0 for c in counts) or any(c < 1 for c in counts[1:-1]):
        raise PipelineConfigError(
            f"{LAYERS_KEY} = {counts}: every middle stage needs at least one block (the first and last may have "
            "0, they hold the embedding and the output head). Move blocks into the empty stages."
        )


def _check_edges(info: dict) -> None:
    edges = info.get("edge_units", [])
    if len(edges) != 2:
        raise PipelineConfigError(
            f"{PP_KEY} > 1 puts the embedding on the first stage and the output head on the last, but the model "
            f"declares edge_units = {edges} (it needs [[embedding...], [norm, head...]]; empty means a tied "
            f"embedding): untie the embedding (model.tie_embeddings = false) or set {PP_KEY} = 1."
        )
