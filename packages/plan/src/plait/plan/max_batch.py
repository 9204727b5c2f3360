"""`plait-plan --plan.max_batch`: the largest local batch that fits a layout, per activation-checkpoint mode.

    plait-plan --config llama3_8B.toml --plan.max_batch [--plan.device h200] [--training.loss chunked]

For the config and its layout as given (degrees, seq_len, accumulation and every other flag, passed
to plait-train's parser unchanged), each AC mode's largest `training.local_batch_size` whose traced
plan fits: the planner's own rule (`report.fits`: the peak of a step after the first within the
device's memory less `report.HEADROOM`). Every answer is a trace of the real step (`make_plan`, in a
forked child as the layout search's), none an estimate.

Few traces: full AC first, at batch 1, then 2; from then on each probe is where the line through
two traced peaks meets the usable memory (the peak grows about linearly with the batch), kept
strictly between the largest batch that fits and the smallest that does not, and bisection where
such a step did not halve that bracket; it ends when the two are one apart. A heavier mode
(selective, then none) saves at least the lighter one's activations at every batch, so its search
starts below the lighter mode's first batch that does not fit. Under pipeline parallel the local
batch is one pipeline step: it moves in steps of pp micro-batches (every schedule's minimum, and
whole rounds of the interleaved ones), and since a schedule keeps a bounded number of
micro-batches in flight the doubling stops at MAX_LOCAL_BATCH.

Tokens per GPU per step: the global batch's tokens over the world (local batch x seq_len x
accumulation x dp / world size, i.e. / (tp x cp x pp)), as the layout search counts them. The
recommendation: the most tokens per GPU per step; on a tie, the mode that recomputes least.
"""

import copy
import dataclasses
from dataclasses import dataclass, field

from plait.trainer.config import ConfigError

from .devices import DEVICES, GIB
from .report import HEADROOM, tokens_per_gpu_per_step

FLAT = 0.01  # a row adding less than this share of the peak: no line yet (see _next_probe)
AC_MODES = ("full", "selective", "none")  # lightest memory first: each bounds the next
MAX_LOCAL_BATCH = 1024  # the doubling's ceiling (a pipeline's memory stops growing with its micro-batches)


@dataclass
class ModeResult:
    ac: str
    local_batch_size: int = 0  # 0: not even the smallest batch fits
    capped: bool = False  # fits at MAX_LOCAL_BATCH (the search stopped there)
    report: dict | None = None  # the plan of local_batch_size


@dataclass
class MaxBatchResult:
    world_size: int
    step: int  # local batches move in these steps (pp micro-batches under pp, else 1)
    usable: float  # bytes a plan may peak at (the device's memory less HEADROOM)
    modes: list = field(default_factory=list)  # [ModeResult], AC_MODES order
    traces: list = field(default_factory=list)  # [{"ac", "local_batch_size", "peak", "fits"}], in order

    def recommended(self) -> ModeResult | None:
        """The most tokens per GPU per step; on a tie the lightest recompute (none, selective, full)."""
        fitting = [m for m in self.modes if m.local_batch_size]
        return max(fitting, key=lambda m: (m.local_batch_size, AC_MODES.index(m.ac)), default=None)

    def smallest_peak(self) -> dict:
        return min(self.traces, key=lambda t: t["peak"])


def check_max_batch_args(plan_args) -> None:
    """The --plan.* flags that make no sense with --plan.max_batch, refused in one line."""
    if plan_args.search:
        raise ConfigError("--plan.max_batch and --plan.search: the search lays out a world, max_batch fills one "
                          "layout; run them one at a time.")
    if plan_args.search_limit is not None:
        raise ConfigError("--plan.search_limit bounds --plan.search's traces; --plan.max_batch takes none (drop it).")


def batch_step(config) -> int:
    """The step of the local batches searched: pp x pipeline_microbatch_size under pp, else 1."""
    p = config.parallelism
    return p.pp * p.pipeline_microbatch_size if p.pp > 1 else 1


def max_batch(config, plan_args, progress=None) -> MaxBatchResult:
    """Each AC mode's largest local batch that fits (module docstring); `progress(line)` hears each trace."""
    from plait.trainer.validate import validate

    from .planning import PlanArgs, check_world_size, default_world_size

    world = plan_args.world_size or default_world_size(config)
    check_world_size(world)
    validate(config, world_size=world, need_data=False)  # the config's own errors, as plait-train's, before a trace
    child_args = PlanArgs(world_size=world, device=plan_args.device, device_memory_gib=plan_args.device_memory_gib,
                          document_tokens=plan_args.document_tokens)
    result = MaxBatchResult(world, batch_step(config), _usable_gib(plan_args)[1] * GIB)
    bound = None  # the lighter mode's first multiple of the step that does not fit
    for ac in AC_MODES:
        mode, bound = _largest(config, child_args, ac, bound, result, progress)
        result.modes.append(mode)
    return result


def _largest(config, plan_args, ac: str, bound: int | None, result: MaxBatchResult, progress):
    """(the mode's ModeResult, its first multiple of the step that does not fit or None): the search
    over multiples k of result.step, each probe `_next_probe`'s."""
    reports, peaks = {}, {}
    top = MAX_LOCAL_BATCH // result.step
    lo, hi = 0, bound  # lo fits (0: nothing known to), hi does not (None: not found yet)
    bisect = False
    while (hi is None or hi - lo > 1) and lo < top:
        k = (lo + hi) // 2 if bisect else _next_probe(peaks, lo, hi, top, result.usable)
        reports[k] = _trace(config, plan_args, ac, k * result.step, result, progress)
        peaks[k] = reports[k]["memory"]["peak"]
        gap = (hi or 2 * top) - lo
        lo, hi = (k, hi) if reports[k]["fits"] else (lo, k)
        # An interpolation that did not halve the bracket is followed by a bisection (at worst
        # every second probe halves it, as bisection alone would).
        bisect = hi is not None and not bisect and (hi - lo) > gap / 2
    return ModeResult(ac, lo * result.step, capped=lo >= top, report=reports.get(lo)), None if lo >= top else hi


def _next_probe(peaks: dict, lo: int, hi: int | None, top: int, usable: float) -> int:
    """The next multiple to trace: where the line through two traced peaks (the bracket's ends, else
    the two largest that fit) meets the usable memory, kept strictly inside the bracket; doubling
    while there is no line. The peak grows about linearly with the batch, so this takes few traces."""
    if not peaks:
        return 1
    fitting = sorted(k for k in peaks if k <= lo)
    line = (lo, hi) if lo and hi in peaks else tuple(fitting[-2:]) if len(fitting) >= 2 else None
    guess = 2 * lo
    if line:
        (a, b), (pa, pb) = line, (peaks[line[0]], peaks[line[1]])
        slope = (pb - pa) / (b - a)
        # A row that adds under 1% of the peak draws no usable line: DeepSeek-V3 16B's batches 1 and 2
        # both peaked at its model state (29.26 GiB), and the line's 1024 cost ~8 of the search's 14
        # minutes. Doubling until the rows show.
        if slope > FLAT * pa:
            rows = (usable - pa) / slope  # multiples beyond a that still fit (inf: no bound)
            guess = top if rows >= top else a + int(rows)
    return max(lo + 1, min(guess, (hi - 1) if hi is not None else top))


def _trace(config, plan_args, ac: str, batch: int, result: MaxBatchResult, progress) -> dict:
    """The planner's report of the config at this local batch and AC mode (a forked child's trace)."""
    from plait.trainer.config import set_value

    from .search import _trace_in_child

    candidate = copy.deepcopy(config)
    set_value(candidate, "training.local_batch_size", str(batch))  # plait-train's own path for --section.key
    set_value(candidate, "training.activation_checkpoint", ac)
    try:
        report = _trace_in_child(candidate, plan_args)
    except RuntimeError as e:
        raise ConfigError(f"--plan.max_batch: the plan of training.local_batch_size {batch}, activation_checkpoint "
                          f"{ac} failed: {e}") from None
    result.traces.append({"ac": ac, "local_batch_size": batch, "peak": report["memory"]["peak"],
                          "fits": report["fits"]})
    if progress:
        progress(f"traced {len(result.traces)}: local batch {batch}, AC {ac}: peak "
                 f"{report['memory']['peak'] / GIB:.2f} GiB, {'fits' if report['fits'] else 'does not fit'}")
    return report


def _tokens(config, result: MaxBatchResult, batch: int) -> float:
    """Tokens per GPU per step of the config's layout at this local batch."""
    t, p = config.training, config.parallelism
    return tokens_per_gpu_per_step(batch, t.seq_len, t.gradient_accumulation_steps,
                                   result.world_size // (p.tp * p.cp * max(1, p.pp)), result.world_size)


def _usable_gib(plan_args) -> tuple[float, float]:
    memory = plan_args.device_memory_gib or DEVICES[plan_args.device].memory_gib
    return memory, memory * (1 - HEADROOM)


def _configured(config, result: MaxBatchResult) -> dict:
    """The config's own batch and mode, and whether it fits (its mode's answer is at least its batch)."""
    t = config.training
    mode = next((m for m in result.modes if m.ac == t.activation_checkpoint), None)
    return {"activation_checkpoint": t.activation_checkpoint, "local_batch_size": t.local_batch_size,
            "tokens_per_gpu_per_step": _tokens(config, result, t.local_batch_size),
            "fits": bool(mode and t.local_batch_size <= mode.local_batch_size)}


def format_max_batch(r: MaxBatchResult, config, plan_args) -> str:
    t = config.training
    memory, usable = _usable_gib(plan_args)
    layout = ", ".join(f"{k} {getattr(config.parallelism, k)}" for k in ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep")
                       if getattr(config.parallelism, k) not in (1, -1))
    head = (f"plait-plan --plan.max_batch: {config.model.name} {config.model.flavor} on {r.world_size} ranks "
            f"({layout or 'FSDP over all'}) of {DEVICES[plan_args.device].name}, {memory:.1f} GiB ({usable:.1f} usable), "
            f"seq_len {t.seq_len} x {t.gradient_accumulation_steps} accumulation; {len(r.traces)} traces")
    best = r.recommended()
    if best is None:
        low = r.smallest_peak()
        return (f"{head}\nno local batch fits: the smallest peak traced is {low['peak'] / GIB:.2f} GiB (local batch "
                f"{low['local_batch_size']}, AC {low['ac']}) over the {usable:.2f} GiB usable")
    lines = [head, "", "AC mode    largest local batch  peak GiB  usable left GiB  tokens/GPU/step"]
    for m in r.modes:
        if not m.local_batch_size:
            lines.append(f"{m.ac:10s} {'none fits':>19s}")
            continue
        peak = m.report["memory"]["peak"] / GIB
        batch = f"{'>= ' if m.capped else ''}{m.local_batch_size}"
        lines.append(f"{m.ac:10s} {batch:>19s}  {peak:8.2f}  {usable - peak:15.2f}  "
                     f"{_tokens(config, r, m.local_batch_size):15,.0f}")
    own = _configured(config, r)
    lines += ["", f"recommended: AC {best.ac}, local batch {best.local_batch_size} "
              f"({_tokens(config, r, best.local_batch_size):,.0f} tokens per GPU per step; the config's "
              f"{own['local_batch_size']}, AC {own['activation_checkpoint']}: {own['tokens_per_gpu_per_step']:,.0f}"
              f"{'' if own['fits'] else ', which does not fit'})",
              f"    --training.local_batch_size {best.local_batch_size} --training.activation_checkpoint {best.ac}"]
    if r.step > 1:
        lines.append(f"local batches searched in steps of {r.step} (pp {config.parallelism.pp} x "
                     f"pipeline_microbatch_size {config.parallelism.pipeline_microbatch_size})")
    return "\n".join(lines)


def max_batch_json(r: MaxBatchResult, config, plan_args) -> dict:
    memory, usable = _usable_gib(plan_args)
    best = r.recommended()
    modes = [{**{k: v for k, v in dataclasses.asdict(m).items() if k != "report"},
              "tokens_per_gpu_per_step": _tokens(config, r, m.local_batch_size),
              "peak": m.report["memory"]["peak"] if m.report else None, "report": m.report} for m in r.modes]
    return {"world_size": r.world_size, "device_memory_gib": memory, "usable_gib": usable, "batch_step": r.step,
            "max_local_batch": MAX_LOCAL_BATCH, "modes": modes, "traces": r.traces,
            "recommended": None if best is None else {"activation_checkpoint": best.ac,
                                                      "local_batch_size": best.local_batch_size,
                                                      "tokens_per_gpu_per_step": _tokens(config, r, best.local_batch_size)},
            "configured": _configured(config, r), "smallest_peak": None if best else r.smallest_peak()}
