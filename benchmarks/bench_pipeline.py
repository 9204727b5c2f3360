"""Pipeline bubble and memory per stage on CPU ranks (gloo): idle fraction per schedule next to theory.

    python benchmarks/bench_pipeline.py                              # PP 2 and 4, the full table (4 min on 2 idle cores)
    python benchmarks/bench_pipeline.py --pp 2 --microbatches 4 --steps 2   # smoke run, well under a minute
    python benchmarks/bench_pipeline.py --microbatches 2=4,8,16 4=8,16 --results benchmarks/RESULTS.md

Model: plait's Llama 3 (debug flavour widened to 8 layers, dim 256, seq 256), fp32, micro-batch
size 1, so a step's work grows with the micro-batch count m and each micro-batch costs the same.
Schedules (torch's, through `plait.pipelineparallel`): GPipe, 1F1B, Interleaved1F1B (2 virtual
stages per rank) and ZBVZeroBubble (2 stages per rank in a V, backward split into input and weight
gradients). One spawn of pp ranks (one thread each) runs every case; the schedules of one m take
turns step by step, so load from other processes on shared cores falls on all of them alike.

What is measured, per rank (= per pp stage; interleaved and V schedules hold 2 stages per rank):
- busy: wall time inside the stage's compute calls, i.e. torch's `PipelineStage.forward_one_chunk`,
  `backward_one_chunk`, `backward_weight_one_chunk` and the loss, timed by wrapping those calls on
  this instance. Not torch.profiler's own labels: torch 2.13 labels GPipe's actions "Forward i"
  around the receive wait, gives 1F1B no labels at all and puts the wait for the receive inside the
  runtime schedules' FORWARD / BACKWARD ranges, so the profile's ranges do not separate compute
  from waiting the same way for every schedule. The compute calls themselves never wait on a peer
  (every receive is waited on before them, every send fired after them), so time inside them is
  compute and time outside is the bubble plus communication. Timing them costs two clock reads per
  call (no profiler overhead on the compute itself). "core share": the thread's CPU time inside
  those calls over their wall time, all ranks together: 1.00 when a rank had a core whenever it
  computed; lower when ranks or other processes competed for the cores (compute stretched, so
  busy reads high and idle low: read such rows with that in mind).
- step: every rank enters `Pipeline.step` after a barrier; the step takes the slowest rank's wall
  time. idle = 1 - busy / step, the median over the timed steps: a rank that returns early (the
  last stage, before the first stage's last backward) idles until the next step, as in training,
  where the gradient clip over the stages waits for all of them. Gloo's waits block
  (the waiting rank leaves the core), so a rank's idle time is real idle time. With more ranks than
  cores (PP 4 on 2 cores), ranks that could compute together take turns: the compute calls stretch
  (busy grows, idle shrinks) and the step is longer; those rows are marked `pp*` and say less
  about the schedule (the same holds when other processes load the cores: the run prints the load).
- "step s": the step's median over the timed steps; "vs 1F1B" is that over 1F1B's at the same
  (pp, m), measured in the same invocation.
- peak: the most bytes of tensor storage alive at once during one extra step, counted over every
  storage the step allocates (a dispatch mode sees each op's outputs; a storage counts until it is
  freed): activations kept for backward, gradients and temporaries. Memory allocated before the
  step is not in it: parameters, and torch's receive buffers, one per micro-batch for activations
  and one for gradients, made at the first step (m x 0.25 MiB each here, the same for every
  schedule). GPipe keeps all m micro-batches' activations until its backward starts, 1F1B at most
  pp - rank.

Theory (the "theory" column): for GPipe and 1F1B the bubble fraction is (p - 1) / (m + p - 1); for
Interleaved1F1B with v virtual stages per rank (p - 1) / (v m + p - 1) (Megatron-LM's (p - 1) / (v m)
bubble over v m micro-batch slots plus itself); ZBVZeroBubble's ideal is 0 (equal forward,
input-backward and weight-backward times and m >= 2p; with unequal times a remainder stays). Those
formulas assume equal stages; here the last stage also holds the norm, the output head (vocab 2048)
and the loss, so the other ranks idle more than the formula says, and the embedding makes stage 0
slightly heavier than the middle ones. "theory, measured stage times" puts the measured compute
per rank (the "compute s" column, per step) into the same model for GPipe and 1F1B: the step takes
sum(t) + (m - 1) max(t) with t a rank's compute per micro-batch, and rank r idles the rest of it.
"""

import argparse
import dataclasses
import datetime
import os
import statistics
import subprocess
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakIdKeyDictionary

from plait.mesh import ParallelDims, build_meshes
from plait.models.llama3 import FLAVORS, Transformer
from plait.pipelineparallel import build_pipeline, schedule_style, split_stages, validate_pipeline_parallel
from plait.testing import run_on_ranks

N_LAYERS, SEQ, MICROBATCH_SIZE = 8, 256, 1
# name -> virtual stages per rank
SCHEDULES = {"GPipe": 1, "1F1B": 1, "Interleaved1F1B": 2, "ZBVZeroBubble": 2}
DEFAULT_MICROBATCHES = {2: [4, 8, 16], 4: [4, 8, 16]}  # ZBV at PP 4 needs m >= 8: skipped at 4


def theory(schedule: str, p: int, m: int) -> float:
    """The schedule's bubble fraction for equal stages (see the module docstring)."""
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if schedule == "Interleaved1F1B":
        return (p - 1) / (SCHEDULES[schedule] * m + p - 1)
    return 0.0


def uneven_theory(busy: list[float], m: int) -> list[float]:
    """Idle per rank of GPipe / 1F1B with the stages' measured compute: the step takes one pass of
    a micro-batch through every stage plus m - 1 more at the slowest stage's pace,
    sum(t) + (m - 1) max(t) with t = busy / m; equal stages give (p - 1) / (m + p - 1)."""
    t = [b / m for b in busy]
    step = sum(t) + (m - 1) * max(t)
    return [1 - b / step for b in busy]


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storage alive that were allocated under this mode, and their peak.

    Each op's outputs are looked at once: a storage not seen before counts its size until Python
    frees it (views and in-place results share a seen storage and add nothing)."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                if storage in self._seen:
                    continue
                nbytes = storage.nbytes()
                self._seen[storage] = True
                weakref.finalize(storage, self._free, nbytes)
                self.live += nbytes
                self.peak = max(self.peak, self.live)
        return out


def _model():
    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=N_LAYERS, max_seq_len=SEQ)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model


def _batch(n_mb: int, vocab: int):
    tokens = torch.randint(0, vocab, (n_mb * MICROBATCH_SIZE, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def _instrument(pipeline, spans: list[tuple[float, float]]) -> None:
    """Time every compute call of this rank's stages (wrapped on these instances only)."""

    def timed(fn):
        def wrapper(*args, **kwargs):
            t0, c0 = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                spans.append((time.perf_counter() - t0, time.thread_time() - c0))

        return wrapper

    for stage in pipeline.pipeline_stages:
        for name in ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk"):
            setattr(stage, name, timed(getattr(stage, name)))
    pipeline.loss.loss_fn = timed(pipeline.loss.loss_fn)


def _summed_ce(logits_BSV, labels_BS):
    return F.cross_entropy(logits_BSV.flatten(0, 1), labels_BS.flatten(), reduction="sum")


def _timed_step(meshes, schedule: str, n_mb: int):
    """Build `schedule` over this rank's stages; return a step function giving (wall s, busy s)."""
    pp = meshes.pp_degree
    model = _model()
    info = model.parallel_info()
    virtual = SCHEDULES[schedule]
    validate_pipeline_parallel(info, pp, schedule, n_mb, None, virtual)
    stages = split_stages(model, info, pp, meshes.pp_rank, None, virtual, schedule_style(schedule))
    pipeline = build_pipeline(stages, meshes.pp.get_group(), schedule, n_mb, _summed_ce, "cpu")
    spans: list[tuple[float, float]] = []
    _instrument(pipeline, spans)
    inputs, labels = _batch(n_mb, FLAVORS["debugmodel"].vocab_size)
    scale = 1.0 / labels.numel()

    def step():
        for m in pipeline.modules:
            m.zero_grad(set_to_none=True)  # every step allocates its gradients: counted in the peak
        dist.barrier(group=meshes.pp.get_group())
        spans.clear()
        t0 = time.perf_counter()
        pipeline.step(inputs, labels, scale=scale)
        wall = time.perf_counter() - t0
        return wall, sum(w for w, _ in spans), sum(c for _, c in spans)

    step.param_bytes = sum(p.numel() * p.element_size() for m in pipeline.modules for p in m.parameters())
    return step


def _rank_main(rank, world_size, cases, steps):
    """Every case on this rank. The schedules of one micro-batch count take turns step by step, so
    load from other processes on the shared cores falls on all of them alike (the ratios vs 1F1B)."""
    meshes = build_meshes(ParallelDims(pp=world_size, dp_shard=1, world_size=world_size))
    out = {}
    for n_mb in dict.fromkeys(m for _, m in cases):
        group = [c for c in cases if c[1] == n_mb]
        steps_by_case = {c: _timed_step(meshes, *c) for c in group}
        for step in steps_by_case.values():
            step()  # warm-up: torch's shape inference, first allocations
        timed = {c: [] for c in group}
        for _ in range(steps):
            for c, step in steps_by_case.items():
                timed[c].append(step())
        for c, step in steps_by_case.items():
            with LiveBytes() as live:
                step()
            walls, busies, cpus = zip(*timed[c])
            out[c] = {"wall": list(walls), "busy": list(busies), "cpu": list(cpus), "peak": live.peak,
                      "params": step.param_bytes}
        del steps_by_case
    return out


def _parse_microbatches(items: list[str], pps: list[int]) -> dict[int, list[int]]:
    """"4,8" for every pp, or "PP=4,8" for one; pp degrees not named keep their defaults."""
    out = {pp: list(DEFAULT_MICROBATCHES.get(pp, [2 * pp])) for pp in pps}
    for item in items or []:
        if "=" in item:
            pp, _, values = item.partition("=")
            out[int(pp)] = [int(v) for v in values.split(",")]
        else:
            out = {pp: [int(v) for v in item.split(",")] for pp in pps}
    return out


def _min_microbatches(schedule: str, pp: int) -> int:
    return 2 * pp if schedule == "ZBVZeroBubble" else pp if schedule != "GPipe" else 1


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)), check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pp", default="2,4", help="pipeline degrees, comma-separated (one spawn each)")
    parser.add_argument("--microbatches", nargs="+", metavar="[PP=]M,M",
                        help="micro-batch counts: '4,8' for every pp or '4=8,16' for one (default 2=4,8,16 4=4,8,16)")
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per case (after 1 warm-up)")
    parser.add_argument("--results", metavar="PATH", help="also put the table into this markdown file, newest first")
    args = parser.parse_args()
    pps = [int(p) for p in args.pp.split(",")]
    microbatches = _parse_microbatches(args.microbatches, pps)
    schedules = args.schedules.split(",")
    if "1F1B" not in schedules:
        schedules.insert(0, "1F1B")  # every ratio is against 1F1B at the same (pp, m)
    cores = len(os.sched_getaffinity(0))
    started, load_before = time.time(), os.getloadavg()[0]
    head = (f"Llama 3 debug widened to {N_LAYERS} layers (dim 256, vocab 2048), seq {SEQ}, micro-batch size "
            f"{MICROBATCH_SIZE}, fp32; {cores} CPU cores, one thread per rank, gloo; torch {torch.__version__}; "
            f"commit {_commit()}; {args.steps} timed steps per case (medians; the schedules of one m take turns step "
            f"by step) after 1 warm-up, peak from 1 more. pp* = more ranks than cores (oversubscribed).")
    print(head, flush=True)
    lines = ["| schedule | pp | m | idle per rank (measured) | mean idle | theory | theory, measured stage times | "
             "compute s per rank | core share | step s | vs 1F1B | peak MiB per rank |",
             "| --- | ---: | ---: | --- | ---: | ---: | --- | --- | ---: | ---: | ---: | --- |"]
    notes = []
    print("\n".join(lines), flush=True)
    for pp in pps:
        cases = [(s, m) for m in microbatches[pp] for s in schedules if m >= _min_microbatches(s, pp)]
        skipped = [(s, m) for m in microbatches[pp] for s in schedules if m < _min_microbatches(s, pp)]
        for s, m in skipped:
            notes.append(f"PP {pp}, m {m}: {s} skipped (it needs m >= {_min_microbatches(s, pp)}).")
        if pp > cores:
            notes.append(f"PP {pp} runs {pp} ranks on {cores} cores (oversubscribed): ranks take turns on the "
                         f"cores, so compute stretches and idle reads low; compare PP {pp} rows with each other.")
        results = run_on_ranks(_rank_main, pp, cases, args.steps, timeout=3600)
        grads = [r[cases[0]]["params"] / 2**20 for r in results]
        notes.append(f"PP {pp}: parameters (= gradient bytes, in the peak) per rank "
                     f"{', '.join(f'{g:.1f}' for g in grads)} MiB for 1-stage schedules.")
        step_s = {c: statistics.median(max(ws) for ws in zip(*(r[c]["wall"] for r in results))) for c in cases}
        for s, m in cases:
            makespans = [max(ws) for ws in zip(*(r[(s, m)]["wall"] for r in results))]
            idle = [statistics.median(1 - b / w for b, w in zip(r[(s, m)]["busy"], makespans)) for r in results]
            busy = [statistics.median(r[(s, m)]["busy"]) for r in results]
            share = sum(sum(r[(s, m)]["cpu"]) for r in results) / sum(sum(r[(s, m)]["busy"]) for r in results)
            uneven = " / ".join(f"{i:.2f}" for i in uneven_theory(busy, m)) if SCHEDULES[s] == 1 else "-"
            base = step_s.get(("1F1B", m))
            row = (f"| {s} | {pp}{'*' if pp > cores else ''} | {m} | {' / '.join(f'{i:.2f}' for i in idle)} | "
                   f"{statistics.mean(idle):.2f} | {theory(s, pp, m):.2f} | {uneven} | "
                   f"{' / '.join(f'{b:.2f}' for b in busy)} | {share:.2f} | {step_s[(s, m)]:.2f} | ")
            row += f"{step_s[(s, m)] / base:.2f} | " if base else "- | "
            row += " / ".join(f"{r[(s, m)]['peak'] / 2**20:.0f}" for r in results) + " |"
            lines.append(row)
            print(row, flush=True)
    minutes = (time.time() - started) / 60
    notes.append(f"Whole run: {minutes:.1f} min; load average (1 min) {load_before:.1f} before, "
                 f"{os.getloadavg()[0]:.1f} after (above {cores}: other processes shared the cores).")
    print("\n" + "\n".join(notes))
    if args.results:
        section = (f"## Pipeline bubble and memory per stage (CPU, gloo), {datetime.date.today()} "
                   f"(`benchmarks/bench_pipeline.py`, run by `nox -s bench`)\n\n{head}\n\n" + "\n".join(lines)
                   + "\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
        body = open(args.results).read()
        title, _, rest = body.partition("\n")
        with open(args.results, "w") as f:
            f.write(f"{title}\n\n{section}{rest}")
        print(f"[bench] section added to {args.results}")


if __name__ == "__main__":
    main()
