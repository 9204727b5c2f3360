"""`plait-plan --plan.search`: the layouts of a model that fit a world of devices, fewest bytes per token first.

    plait-plan --config llama3_8B.toml --plan.search --plan.world_size 64 [--plan.search_limit 12]

For the config's model, sequence length and global batch it enumerates candidates:

- degrees, powers of two with product world_size: pp <= 8 (the config's schedule and virtual
  stages, one sequence per pipeline micro-batch), dp_replicate, dp_shard, tp <= 8 (inside a node),
  cp <= 8, and for MoE models ep dividing the routed experts with etp 1 or tp;
- activation checkpointing none / selective / full;
- the micro-batch: local_batch_size x gradient_accumulation_steps = the config's sequences per
  data-parallel rank at this world size, so the global batch stays the config's (where the data
  parallel degree is larger than the global batch, one sequence per rank: the output says so);
  under pp the whole local batch is one pipeline step (accumulation 1).

Each goes through plait-train's `validate` (invalid ones are counted, not shown); the analytic
estimate of `memory_estimate.py` drops those over twice the usable memory; the rest are traced
with the real planner (`make_plan`), at most --plan.search_limit of them. Which first: those the
estimate says fit, in the order of a rough analytic bytes-per-token figure (comm_guess.py, used for
that order only; every number printed is traced). Once a layout's degrees fit, their other AC and
micro-batch variants are not traced (they send more per token: smaller micro-batches repeat
FSDP's gathers, full AC repeats TP's collectives); once a candidate does not fit, the ones that
need at least as much memory (same degrees, micro-batch as large, lighter AC) are skipped.

Communication per token: the bytes a rank's collectives put on the wire per step (ring algorithms,
`collectives.wire_factor`) over the tokens per rank per step (global batch tokens / world size).
"""

import copy
import math
from dataclasses import dataclass, field

from plait.trainer.config import ConfigError

from .collectives import wire_factor
from .comm_guess import comm_guess, model_shape
from .devices import DEVICES, GIB
from .report import HEADROOM, tokens_per_gpu_per_step

AC_MODES = ("none", "selective", "full")  # lighter memory last
MAX_TP = 8  # tensor parallel stays inside an 8-GPU node (its collectives are per block)
MAX_CP = 8
MAX_PP = 8
DEFAULT_LIMIT = 12
PRUNE_FACTOR = 2.0  # analytic estimate over this x usable memory: not traced


@dataclass
class Candidate:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int
    cp: int
    ep: int
    etp: int
    local_batch_size: int
    accumulation: int
    ac: str
    estimate: int = 0  # analytic peak bytes (memory_estimate.py)
    guess: float = 0.0  # analytic wire bytes per token (trace order only)

    @property
    def degrees(self) -> tuple:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp, self.cp, self.ep, self.etp)

    def overrides(self) -> list[tuple[str, str]]:
        """The `--section.key value` pairs of this layout, as plait-train's parser yields them."""
        keys = [("parallelism.dp_replicate", self.dp_replicate), ("parallelism.dp_shard", self.dp_shard),
                ("parallelism.tp", self.tp), ("parallelism.cp", self.cp), ("parallelism.ep", self.ep),
                ("parallelism.etp", self.etp), ("parallelism.pp", self.pp),
                ("training.local_batch_size", self.local_batch_size),
                ("training.gradient_accumulation_steps", self.accumulation),
                ("training.activation_checkpoint", self.ac)]
        if self.pp > 1:
            keys.append(("parallelism.pipeline_microbatch_size", 1))
        return [(k, str(v)) for k, v in keys]

    def flags(self) -> list[str]:
        return [s for k, v in self.overrides() for s in (f"--{k}", v)]

    def heavier_or_equal(self, other: "Candidate") -> bool:
        """Needs at least `other`'s memory: the same tp, cp, ep and etp, FSDP over as few ranks
        (replicas hold as much as one shard group), a micro-batch as large, AC as light."""
        return ((self.pp, self.tp, self.cp, self.ep, self.etp) == (other.pp, other.tp, other.cp, other.ep, other.etp)
                and self.dp_shard <= other.dp_shard and self.local_batch_size >= other.local_batch_size
                and AC_MODES.index(self.ac) <= AC_MODES.index(other.ac))


@dataclass
class SearchResult:
    world_size: int
    global_sequences: int
    config_global_sequences: int
    counts: dict = field(default_factory=dict)
    fits: list = field(default_factory=list)  # [{candidate, report, comm_bytes_per_token}]
    not_fitting: list = field(default_factory=list)
    failed: list = field(default_factory=list)


def _powers_of_two(limit: int) -> list[int]:
    return [2**i for i in range(int(math.log2(limit)) + 1)] if limit >= 1 else []


def _routed_experts(model, info) -> int:
    experts = info.get("experts", [])
    return model.get_submodule(experts[0]).w1.shape[0] if experts else 0


def degree_layouts(world_size: int, n_experts: int):
    """(pp, dp_replicate, dp_shard, tp, cp, ep, etp), powers of two whose dense product is world_size."""
    if world_size & (world_size - 1):
        raise ConfigError(f"--plan.world_size = {world_size}: --plan.search lays out powers of two; use one.")
    for pp in _powers_of_two(min(MAX_PP, world_size)):
        for tp in _powers_of_two(min(MAX_TP, world_size // pp)):
            for cp in _powers_of_two(min(MAX_CP, world_size // (pp * tp))):
                for dp_replicate in _powers_of_two(world_size // (pp * tp * cp)):
                    dp_shard = world_size // (pp * tp * cp * dp_replicate)
                    eps = [e for e in _powers_of_two(world_size) if n_experts and n_experts % e == 0] or [1]
                    for ep in eps:
                        for etp in sorted({1, tp}) if ep > 1 else [1]:
                            yield pp, dp_replicate, dp_shard, tp, cp, ep, etp


def global_sequences(config, world_size: int) -> int:
    """Sequences per step of the config at this world size (its own degrees; pure data parallel
    if they do not divide it)."""
    from plait.mesh import ParallelDims

    p, t = config.parallelism, config.training
    try:
        dims = ParallelDims(pp=p.pp, dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, cp=p.cp, tp=p.tp,
                            ep=p.ep, etp=p.etp, world_size=world_size)
        dp = dims.dp_replicate * dims.dp_shard
    except ValueError:
        dp = world_size
    return t.local_batch_size * t.gradient_accumulation_steps * dp


def traced_comm_per_token(report: dict, world_size: int) -> float:
    """Wire bytes per token of a traced plan (see the module docstring)."""
    wire = sum(c["bytes"] * wire_factor(c["kind"], c["ranks"]) for c in report["communication"])
    layout = report["layout"]
    b, s = report["micro_batch"]
    return wire / tokens_per_gpu_per_step(b, s, report["gradient_accumulation_steps"],
                                          layout["dp_replicate"] * layout["dp_shard"], world_size)


def _with(config, c: Candidate):
    from plait.trainer.config import set_value

    candidate = copy.deepcopy(config)
    for key, value in c.overrides():
        set_value(candidate, key, value)  # plait-train's own path for --section.key value
    return candidate


def _trace_in_child(config, plan_args) -> dict:
    """make_plan in a forked child: each trace starts from a clean torch (process-group names and
    DTensor's caches of one fake world break the next one in the same process), without paying
    the imports again."""
    import multiprocessing
    import traceback

    # What a trace imports, imported once here: every child inherits it instead of paying seconds.
    from torch._subclasses import fake_tensor  # noqa: F401
    from torch.testing._internal.distributed import fake_pg  # noqa: F401

    from plait.trainer import lr_scheduler, moe_step, optimizer, parallelize, train  # noqa: F401

    from . import report, trace  # noqa: F401
    from .planning import make_plan

    ctx = multiprocessing.get_context("fork")
    receive, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(("ok", make_plan(config, plan_args)))
        except BaseException as e:  # noqa: BLE001 - whatever it is goes back to the parent as one line
            last = traceback.extract_tb(e.__traceback__)[-1:]
            where = f" ({last[0].filename.rsplit('/', 1)[-1]}:{last[0].lineno})" if last else ""
            send.send(("error", f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}{where}"))

    process = ctx.Process(target=child, daemon=True)
    process.start()
    send.close()
    try:
        status, value = receive.recv()
    except EOFError:
        status, value = "error", "the tracing process died"
    process.join()
    if status == "error":
        raise RuntimeError(value)
    return value


@dataclass
class _Space:
    """What every candidate of one search is laid out on and measured against."""

    world: int
    base: object  # the config with pp 1 (each candidate sets its own degrees)
    usable: float  # bytes of a device's memory a plan may use
    n_experts: int  # routed experts of the model (0: dense)
    shape: dict  # comm_guess.model_shape
    seq_len: int
    act_bytes: int
    wanted: int  # global_sequences of the config


def search(config, plan_args, progress=None) -> SearchResult:
    """Enumerate, validate, prune and trace (module docstring); `progress(line)` hears each trace."""
    space = _search_space(config, plan_args)
    limit = plan_args.search_limit if plan_args.search_limit is not None else DEFAULT_LIMIT
    result = SearchResult(space.world, 0, space.wanted)
    result.counts = {"candidates": 0, "invalid": 0, "over_memory": 0, "traced": 0, "fit": 0, "do_not_fit": 0,
                     "trace_failed": 0, "not_traced_limit": 0, "variants_of_fitting": 0, "heavier_than_not_fitting": 0}
    queue = _candidates(space, result)
    # Equal guesses (no FSDP to repeat): the larger micro-batch, then the lighter AC (less recompute).
    queue.sort(key=lambda c: (c.estimate > space.usable, c.guess, -c.local_batch_size, AC_MODES.index(c.ac)))
    _trace_queue(queue, space, plan_args, limit, result, progress)
    result.fits.sort(key=lambda r: r["comm_bytes_per_token"])
    return result


def _search_space(config, plan_args) -> _Space:
    """The world, the usable memory, and the model as plait-train builds it (validated once, on one
    FSDP group of the whole world)."""
    from plait.trainer.validate import validate

    world = plan_args.world_size
    if not world:
        raise ConfigError("--plan.search needs --plan.world_size N (the ranks to lay the model out on).")
    device = DEVICES[plan_args.device]
    usable = (plan_args.device_memory_gib or device.memory_gib) * GIB * (1 - HEADROOM)
    base = copy.deepcopy(config)
    base.parallelism.pp = 1
    base.parallelism.layers_per_stage = []  # the config's split is for its own pp: candidates split evenly
    first = validate(_with(base, Candidate(1, 1, world, 1, 1, 1, 1, 1, 1, "none")), world_size=world, need_data=False)
    return _Space(world, base, usable, n_experts=_routed_experts(first.model, first.info),
                  shape=model_shape(first.model, first.info), seq_len=config.training.seq_len,
                  act_bytes=2 if config.training.dtype == "bfloat16" else 4, wanted=global_sequences(config, world))


def _candidates(space: _Space, result: SearchResult) -> list[Candidate]:
    """The candidates that validate and that the analytic estimate keeps, each with its estimate and
    comm guess; result's counts and global_sequences follow."""
    from plait.trainer.memory_estimate import estimate_memory

    counts, queue, valid_cache = result.counts, [], {}
    for degrees in degree_layouts(space.world, space.n_experts):
        dp = degrees[1] * degrees[2]
        per_rank = space.wanted // dp if space.wanted % dp == 0 and space.wanted >= dp else 1
        result.global_sequences = max(result.global_sequences, per_rank * dp)
        # Under pp the local batch is one pipeline step of per_rank micro-batches.
        batches = [per_rank] if degrees[0] > 1 else [b for b in _powers_of_two(per_rank) if per_rank % b == 0]
        for lbs in batches:
            for ac in AC_MODES:
                c = Candidate(*degrees, lbs, per_rank // lbs, ac)
                counts["candidates"] += 1
                key = (degrees, lbs)  # validate reads no AC setting: once per degrees and micro-batch
                if key not in valid_cache:
                    valid_cache[key] = _validated(space, c)
                plan = valid_cache[key]
                if plan is None:
                    counts["invalid"] += 1
                    continue
                c.estimate = estimate_memory(_with(space.base, c), plan.dims, plan.model, plan.info).total
                if c.estimate > PRUNE_FACTOR * space.usable:
                    counts["over_memory"] += 1
                    continue
                c.guess = comm_guess(c, space.shape, space.seq_len, space.act_bytes, space.world)
                queue.append(c)
    return queue


def _validated(space: _Space, c: Candidate):
    """plait-train's validation of the candidate's config, or None where it refuses it."""
    from plait.trainer.validate import validate

    try:
        return validate(_with(space.base, c), world_size=space.world, need_data=False)
    except ConfigError:
        return None


def _trace_queue(queue: list[Candidate], space: _Space, plan_args, limit: int, result: SearchResult,
                 progress) -> None:
    """Trace the queue in its order, at most `limit`, skipping what need not be (module docstring)."""
    from .planning import PlanArgs

    counts, fitting_degrees, refused = result.counts, set(), []
    for c in queue:
        skipped = _skipped(c, fitting_degrees, refused, counts["traced"], limit)
        if skipped:
            counts[skipped] += 1
            continue
        counts["traced"] += 1
        args = PlanArgs(world_size=space.world, device=plan_args.device, device_memory_gib=plan_args.device_memory_gib,
                        document_tokens=plan_args.document_tokens)
        try:
            report = _trace_in_child(_with(space.base, c), args)
        except RuntimeError as e:  # a layout the tracer cannot follow is reported, not fatal
            counts["trace_failed"] += 1
            result.failed.append({"flags": c.flags(), "error": str(e)})
            continue
        row = {"flags": c.flags(), "comm_bytes_per_token": traced_comm_per_token(report, space.world),
               "analytic_estimate": c.estimate, "report": report}
        if report["fits"]:
            counts["fit"] += 1
            fitting_degrees.add(c.degrees)
            result.fits.append(row)
        else:
            counts["do_not_fit"] += 1
            refused.append(c)
            result.not_fitting.append(row)
        if progress:
            progress(f"traced {counts['traced']}/{limit}: {' '.join(c.flags())}: peak "
                     f"{report['memory']['peak'] / GIB:.1f} GiB, {'fits' if report['fits'] else 'does not fit'}")


def _skipped(c: Candidate, fitting_degrees: set, refused: list[Candidate], traced: int, limit: int) -> str | None:
    """The count a candidate left untraced falls under, or None to trace it."""
    if c.degrees in fitting_degrees:
        return "variants_of_fitting"
    if any(c.heavier_or_equal(r) for r in refused):
        return "heavier_than_not_fitting"
    if traced >= limit:
        return "not_traced_limit"
    return None


def _layout(flags: list[str]) -> str:
    """A short name of a candidate's flags: the degrees above 1, the micro-batch and AC."""
    v = {k.rsplit(".", 1)[1]: value for k, value in zip(flags[::2], flags[1::2])}
    names = ("pp", "dp_replicate", "dp_shard", "tp", "cp", "ep", "etp")
    degrees = " x ".join(f"{k} {v[k]}" for k in names if v[k] != "1")
    return (f"{degrees or 'one rank'}, micro-batch {v['local_batch_size']} x {v['gradient_accumulation_steps']}, "
            f"AC {v['activation_checkpoint']}")


def format_search(r: SearchResult, config, plan_args) -> str:
    c = r.counts
    device = DEVICES[plan_args.device]
    memory = plan_args.device_memory_gib or device.memory_gib
    batch_note = "" if r.global_sequences == r.config_global_sequences else (
        f" (the config's {r.config_global_sequences} is fewer than some layouts' data-parallel ranks: one "
        "sequence per rank there)")
    lines = [
        f"plait-plan --plan.search: {config.model.name} {config.model.flavor} on {r.world_size} ranks of "
        f"{device.name}, {memory:.1f} GiB ({memory * (1 - HEADROOM):.1f} usable), global batch up to "
        f"{r.global_sequences} x {config.training.seq_len} tokens{batch_note}",
        f"searched: pp <= {MAX_PP} ({config.parallelism.pipeline_schedule}, {config.parallelism.pipeline_virtual_stages}"
        f" stage(s) per rank), dp_replicate, dp_shard, tp <= {MAX_TP}, cp <= {MAX_CP}, ep (dividing the routed "
        "experts), etp (1 or tp), AC none / selective / full, micro-batch x accumulation",
        f"{c['candidates']} candidates: {c['invalid']} invalid (plait-train's validation), {c['over_memory']} over "
        f"{PRUNE_FACTOR:g}x the usable memory by the analytic estimate, {c['traced']} traced ({c['fit']} fit, "
        f"{c['do_not_fit']} do not, {c['trace_failed']} failed to trace), {c['not_traced_limit']} not traced "
        f"(--plan.search_limit {c['traced'] if c['not_traced_limit'] else 'not reached'}), "
        f"{c['variants_of_fitting']} AC / micro-batch variants of degrees that already fit, "
        f"{c['heavier_than_not_fitting']} needing at least the memory of one that does not fit",
        "",
    ]
    if not r.fits:
        lines.append("no traced layout fits" + (": raise --plan.search_limit, or the world size"
                                                if c["not_traced_limit"] else ": raise the world size"))
    else:
        lines.append(" #  comm/token  comm GiB/step  comm ms  compute ms  peak GiB  layout")
        for i, row in enumerate(r.fits, 1):
            rep = row["report"]
            comm = sum(x["bytes"] for x in rep["communication"])
            lines.append(f"{i:2d}  {row['comm_bytes_per_token'] / 1024:6.1f} KiB  {comm / GIB:13.2f}  "
                         f"{rep['communication_seconds'] * 1e3:7.1f}  {rep['compute_seconds'] * 1e3:10.1f}  "
                         f"{rep['memory']['peak'] / GIB:8.2f}  {_layout(row['flags'])}")
            lines.append("    " + " ".join(row["flags"]))
    for row in r.not_fitting:
        lines.append(f"  does not fit (peak {row['report']['memory']['peak'] / GIB:.1f} GiB): {_layout(row['flags'])}")
    for row in r.failed:
        lines.append(f"  failed to trace: {_layout(row['flags'])}: {row['error']}")
    lines += ["", "comm/token: wire bytes of a rank's collectives per step (ring algorithms) over its tokens per step "
              "(global batch tokens / ranks); flags: after plait-train --config <the same config and flags>"]
    return "\n".join(lines)


def search_json(r: SearchResult) -> dict:
    return {"world_size": r.world_size, "global_sequences": r.global_sequences,
            "config_global_sequences": r.config_global_sequences, "counts": r.counts, "pp_searched": MAX_PP > 1,
            "fits": r.fits, "not_fitting": r.not_fitting, "failed": r.failed}
