"""The benchmark suite (`nox -s bench`): plait vs torchtitan 0.3.0, where plait's step goes,
scaling on this machine; every figure a ratio measured in this one invocation.

    python benchmarks/suite.py [--steps 10] [--warmup 3] [--rounds 1] [--only NAME,...]
        [--skip-torchtitan] [--no-compile] [--no-results] [TOKENIZER_DIR]

1. Against torchtitan 0.3.0 with equal work (same model dims, seq_len, local batch, ranks, steps,
   bf16 compute with fp32 master weights, no activation checkpointing, causal SDPA attention on
   both sides (torchtitan's Flex has no CPU backward: torchtitan_cpu.py swaps in its own SDPA
   attention; plait's debug configs are causal), torch's bf16 kernels on both sides (plait with
   `--training.cpu_bf16 native`), the text of plait's built-in corpus), each framework as it
   comes (eager) and both compiled:
     llama3-1        Llama 3 debug, seq 512, batch 8, 1 rank
     llama3-fsdp2    Llama 3 debug, seq 512, batch 8 per rank, 2 ranks FSDP
     deepseek-1      DeepSeek-V3 debug, seq 256, batch 4, 1 rank
     deepseek-fsdp2  DeepSeek-V3 debug, 2 ranks FSDP (every rank holds every expert)
     deepseek-ep2    DeepSeek-V3 debug, 2 ranks FSDP 2 x EP 2 (all-to-all dispatch)
   On a CPU that emulates bf16 (no AVX512-BF16 / AMX / ARM BF16) plait's default route runs its
   bf16 products through fp32 kernels: that gain is a row of its own (plait auto / plait native,
   the same configs), never part of the plait / torchtitan ratio.
   Rounds alternate which framework runs first; the first `--warmup` steps are dropped; the
   figure is the median global tokens/s over the kept steps of all rounds. Peak memory per rank:
   the largest resident set of any process of the run (measured outside both frameworks alike).
   Both run with OMP_WAIT_POLICY=PASSIVE (plait-train's default; torchtitan's spinning OpenMP
   threads are otherwise slower on 2 shared cores, which would flatter plait).
2. Where plait's step goes: one extra profiled plait run per config and mode (torch.profiler,
   rank 0), split into attention / matmul / elementwise / compiled / communication / optimizer /
   Python (benchmarks/profile_summary.py).
3. The bound: kernel share = kernel time / step time in plait's profile, and (plait /
   torchtitan) / kernel share = the ratio plait would reach with zero overhead on today's kernels.
   Where that is below the 1.5x target, the kernels, not the framework, set the limit.
4. Scaling on this machine (2 cores in all, so ideal is 1.0x, not 2x): FSDP 1 -> 2 ranks at a
   fixed global batch; TP 2; CP 2 (all-gather and ring) at seq 4096; EP 2 vs EP 1; and, from the
   2-rank profiles, communication exposed vs overlapped, and how much of the exposed part was
   waiting for the other rank to arrive (benchmarks/comm_skew.py).

The script prints every table and appends them as a dated section (machine, commit, torch) to
benchmarks/RESULTS.md (not with --no-results). torchtitan must be importable (the bench session
installs torchtitan==0.3.0 next to the pinned torch) or is put in benchmarks/.venv on first use.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from comm_skew import peer_wait  # noqa: E402
from common import (  # noqa: E402
    ANSI,
    CORPUS_DIR,
    REPO,
    TORCHTITAN_VERSION,
    TT_STEP,
    ensure_torchtitan_venv,
    torch_version,
)
from profile_summary import CATEGORIES, kernel_ms, summarize  # noqa: E402

TARGET = 1.5
RUN_TIMEOUT_S = 1200  # one benchmark run, compile included
# Peak RSS of the wrapped command's largest descendant (ru_maxrss: KiB on Linux).
_WRAP = (
    "import resource, subprocess, sys; rc = subprocess.call(sys.argv[2:]); "
    "open(sys.argv[1], 'w').write(str(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)); sys.exit(rc)"
)


@dataclass(frozen=True)
class Config:
    model: str  # llama3 | deepseek_v3
    seq: int
    batch: int  # per rank
    ranks: int = 1
    ep: int = 1
    tp: int = 1
    cp: int = 1
    cp_method: str = "allgather"
    torchtitan: bool = True  # compared with torchtitan (else plait only: a scaling run)
    extra: tuple = field(default_factory=tuple)


CONFIGS = {
    "llama3-1": Config("llama3", 512, 8),
    "llama3-fsdp2": Config("llama3", 512, 8, ranks=2),
    "deepseek-1": Config("deepseek_v3", 256, 4),
    "deepseek-fsdp2": Config("deepseek_v3", 256, 4, ranks=2),
    "deepseek-ep2": Config("deepseek_v3", 256, 4, ranks=2, ep=2),
}
LONG = ("--model.max_seq_len", "4096")  # the debug flavor's RoPE table stops at 2048
SCALING = {
    "llama3-fsdp2-gb8": Config("llama3", 512, 4, ranks=2, torchtitan=False),  # global batch 8, as llama3-1
    "llama3-tp2": Config("llama3", 512, 8, ranks=2, tp=2, torchtitan=False),
    "llama3-seq4096-1": Config("llama3", 4096, 1, torchtitan=False, extra=LONG),
    "llama3-seq4096-cp2-allgather": Config("llama3", 4096, 1, ranks=2, cp=2, torchtitan=False, extra=LONG),
    "llama3-seq4096-cp2-ring": Config("llama3", 4096, 1, ranks=2, cp=2, cp_method="ring", torchtitan=False, extra=LONG),
}
ALL = {**CONFIGS, **SCALING}


@dataclass
class Run:
    tps: list[float] = field(default_factory=list)  # kept steps of every round
    per_round: list[float] = field(default_factory=list)
    peak_gib: float = 0.0
    error: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def median(self) -> float | None:
        return statistics.median(self.tps) if self.tps else None


def _measured(cmd: list[str], env: dict, log: Path, cwd: Path) -> tuple[int, float]:
    """Run `cmd` (stdout+stderr to `log`); its exit code and the peak RSS of its largest process (GiB)."""
    peak_file = log.with_suffix(".maxrss")
    with open(log, "w") as f:
        # Its own process group, so a run that hangs is killed with every rank it started.
        proc = subprocess.Popen([sys.executable, "-c", _WRAP, str(peak_file), *cmd], stdout=f,
                                stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)  # fmt: skip
        try:
            rc = proc.wait(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            f.write(f"\n[bench] killed: no exit within {RUN_TIMEOUT_S} s (Error: timeout)\n")
            return 124, 0.0
    peak = int(peak_file.read_text()) / 2**20 if peak_file.exists() else 0.0
    return rc, peak


def _tail(log: Path, lines: int = 3) -> str:
    text = ANSI.sub("", log.read_text()) if log.exists() else ""
    errors = [line for line in text.splitlines() if "Error" in line or "error" in line]
    return (errors[-1] if errors else " | ".join(text.splitlines()[-lines:]))[:300]


def plait_cmd(config: Config, dump: Path, steps: int, compile: bool, profile_at: int = 0,
              cpu_bf16: str = "native") -> list[str]:  # fmt: skip
    """`cpu_bf16`: plait's CPU kernel route (native: torch's bf16 kernels, torchtitan's; auto: the
    fp32 kernels where this CPU emulates bf16, the route's own row)."""
    args = [sys.executable, "-m", "plait.trainer", "--job.dump_folder", str(dump), "--training.cpu_bf16", cpu_bf16,
            "--config", f"{config.model}_debugmodel.toml",
            "--training.seq_len", str(config.seq), "--training.local_batch_size", str(config.batch),
            "--training.dtype", "bfloat16", "--training.steps", str(steps),
            "--training.activation_checkpoint", "none", "--training.compile", str(compile).lower(),
            "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
            "--checkpoint.enable", "false"]  # fmt: skip
    if config.ranks > 1:
        args += ["--nproc-per-node", str(config.ranks)]
    for axis in ("ep", "tp", "cp"):
        if getattr(config, axis) > 1:
            args += [f"--parallelism.{axis}", str(getattr(config, axis))]
    if config.cp > 1:
        args += ["--parallelism.cp_method", config.cp_method, "--parallelism.dp_shard", "1"]
    if config.tp > 1:
        args += ["--parallelism.dp_shard", "1"]
    if profile_at:
        args += ["--metrics.profile_interval", str(profile_at)]
    return [*args, *config.extra]


def run_plait(config: Config, workdir: Path, name: str, steps: int, warmup: int, compile: bool,
              cpu_bf16: str = "native") -> Run:  # fmt: skip
    dump = workdir / name
    log = workdir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    rc, peak = _measured(plait_cmd(config, dump, steps, compile, cpu_bf16=cpu_bf16), env, log, workdir)
    if rc != 0:
        return Run(error=f"exit {rc}: {_tail(log)}")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "tokens_per_second" in r]
    run = Run(tps=[r["tokens_per_second"] for r in rows if r["step"] > warmup], peak_gib=peak)
    if config.ep > 1:
        run.extra["host_syncs_per_step"] = statistics.median(r.get("moe_host_syncs", 0) for r in rows)
    return run


def torchtitan_cmd(python: Path, config: Config, dump: Path, steps: int, compile: bool, tokenizer: Path,
                   port: int) -> list[str]:  # fmt: skip
    script = [str(HERE / "torchtitan_cpu.py")]
    if config.ranks > 1:
        launcher = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(config.ranks)]
    else:
        launcher = [str(python)]
    flavor = f"{config.model}_debugmodel"
    args = [*launcher, *script, "--module", config.model, "--config", flavor,
            "--hf_assets_path", str(tokenizer), "--dataloader.dataset_path", str(CORPUS_DIR),
            "--dump_folder", str(dump), "--training.seq_len", str(config.seq),
            "--training.local_batch_size", str(config.batch), "--training.steps", str(steps),
            "--training.mixed_precision_param", "bfloat16", "--metrics.log_freq", "1"]  # fmt: skip
    # The FSDP (+ EP) path that runs on gloo: torchtitan's default spmd_types backend stops in FSDP
    # init on CPU (see torchtitan_cpu.py); no CUDA graph on CPU.
    args += ["--parallelism.spmd_backend", "partial_dtensor",
             "--parallelism.data_parallel_shard_degree", str(config.ranks)]  # fmt: skip
    if config.model == "deepseek_v3":
        args += ["--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", str(config.ep)]
    if compile:
        args.append("--compile.enable")
    return [*args, "activation_checkpoint:none"]


def run_torchtitan(python: Path, config: Config, workdir: Path, name: str, args, compile: bool) -> Run:
    dump = workdir / name
    log = workdir / f"{name}.log"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    if config.ranks == 1:
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(args.port))  # fmt: skip
    cmd = torchtitan_cmd(python, config, dump, args.steps, compile, args.tokenizer, args.port)
    rc, peak = _measured(cmd, env, log, workdir)
    if rc != 0:
        return Run(error=f"exit {rc}: {_tail(log)}")
    # Every rank logs its step lines; tps is per data-parallel rank: global = tps x ranks.
    per_step: dict[int, float] = {}
    for m in TT_STEP.finditer(ANSI.sub("", log.read_text())):
        per_step.setdefault(int(m.group(1)), float(m.group(2).replace(",", "")) * config.ranks)
    return Run(tps=[t for s, t in sorted(per_step.items()) if s > args.warmup], peak_gib=peak)


def profile_plait(config: Config, workdir: Path, name: str, compile: bool, at: int) -> dict | None:
    dump = workdir / f"{name}-profile"
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_WAIT_POLICY="PASSIVE")
    rc, _ = _measured(plait_cmd(config, dump, at, compile, profile_at=at), env, workdir / f"{name}-profile.log",
                      workdir)  # fmt: skip
    traces = sorted((dump / "profile").glob("*_rank0.json")) if rc == 0 else []
    if not traces:
        return None
    summary = summarize(traces[-1])
    every_rank = sorted(traces[-1].parent.glob(traces[-1].name.replace("_rank0", "_rank*")))
    if len(every_rank) > 1:  # rank 0 first: "rank0" sorts before every other rank's name
        summary["exposed_peer_late_ms"] = peer_wait(every_rank)[0]["exposed_peer_late_ms"]
        # Each rank's kernel time, as a share of its own profiled step (the ranks' steps end together).
        summary["rank_kernel_shares"] = [kernel_ms(s) / s["step_ms"] for s in map(summarize, every_rank)]
    return summary


def _merge(into: Run, run: Run) -> None:
    if run.error:
        into.error = into.error or run.error
        return
    into.tps += run.tps
    into.per_round.append(statistics.median(run.tps))
    into.peak_gib = max(into.peak_gib, run.peak_gib)
    into.extra.update(run.extra)


def _ratio(a: Run | None, b: Run | None) -> str:
    if not a or not b or a.median is None or b.median is None:
        return "-"
    rounds = [x / y for x, y in zip(a.per_round, b.per_round)]
    spread = f" ({min(rounds):.2f}-{max(rounds):.2f})" if len(rounds) > 1 else ""
    return f"{a.median / b.median:.2f}x{spread}"


def _tps(run: Run | None) -> str:
    if run is None:
        return "-"
    return f"{run.median:,.0f}" if run.median is not None else f"failed ({run.error[:80]})"


def _mem(run: Run | None) -> str:
    return f"{run.peak_gib:.2f}" if run and run.peak_gib else "-"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cpu}, {cores} cores, {bf16_units()}"


def cpu_has_bf16_units() -> bool:
    """plait's own answer (plait.models.cpu_bf16: x86 AVX512-BF16 / AMX, ARM BF16)."""
    from plait.models import cpu_bf16

    return cpu_bf16.CPU_BF16_UNITS


def bf16_units() -> str:
    """Whether the CPU multiplies bf16 natively: without AVX512-BF16 or AMX, oneDNN emulates it and a
    bf16 matmul took ~5x an fp32 one (Xeon without either, 2026-11-27), so bf16 runs are far more
    matmul-bound there than on a CPU with them: compare bf16 numbers only between such machines."""
    return "native bf16 matmul" if cpu_has_bf16_units() else "no native bf16 matmul (AVX512-BF16 / AMX / ARM BF16 absent)"


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=REPO).stdout.strip()  # fmt: skip
    return (out.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


def report(args, runs: dict[str, Run], profiles: dict[str, dict]) -> str:
    modes = ["eager"] + ([] if args.no_compile else ["compile"])
    out = []
    out.append("### plait vs torchtitan 0.3.0 (global tokens/s, median of kept steps; peak RSS per rank, GiB)\n")
    out.append("| config | mode | plait tok/s | torchtitan tok/s | plait / torchtitan | plait GiB | torchtitan GiB |")
    out.append("|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        if name not in args.names:
            continue
        for mode in modes:
            p, t = runs.get(f"plait:{name}:{mode}"), runs.get(f"torchtitan:{name}:{mode}")
            out.append(f"| {name} | {mode} | {_tps(p)} | {_tps(t)} | {_ratio(p, t)} | {_mem(p)} | {_mem(t)} |")
    out.append("")
    route = [(name, mode) for name in CONFIGS if name in args.names for mode in modes
             if f"plait-route:{name}:{mode}" in runs]
    if route:
        out.append("### The CPU kernel route's own gain (plait `--training.cpu_bf16 auto` / `native`; this CPU "
                   "emulates bf16, so auto runs the bf16 products and attention through fp32 kernels)\n")
        out.append("| config | mode | plait auto tok/s | plait native tok/s | auto / native |")
        out.append("|---|---|---|---|---|")
        for name, mode in route:
            a, n = runs.get(f"plait-route:{name}:{mode}"), runs.get(f"plait:{name}:{mode}")
            out.append(f"| {name} | {mode} | {_tps(a)} | {_tps(n)} | {_ratio(a, n)} |")
        out.append("")
    out.append("### Where plait's step goes (rank 0, one profiled step; ms)\n")
    out.append("| config | mode | step | " + " | ".join(CATEGORIES) + " | comm total | top ops |")
    out.append("|---|---|---" + "|---" * len(CATEGORIES) + "|---|---|")
    for key, s in profiles.items():
        _, name, mode = key.split(":")
        top = ", ".join(f"{op.replace('aten::', '')} {ms:.0f}" for op, ms in s["top_ops"][:4])
        cells = " | ".join(f"{s[f'{c}_ms']:.0f}" for c in CATEGORIES)
        out.append(f"| {name} | {mode} | {s['step_ms']:.0f} | {cells} | {s['comm_total_ms']:.0f} | {top} |")
    out.append("")
    out.append(f"### The {TARGET}x target and the kernels' bound\n")
    out.append("kernel share = kernel time / step time in plait's profiled step (the profiler's per-op cost "
               "inflates absolute times, so the share is applied to the unprofiled step); bound = plait / "
               "torchtitan / kernel share: the ratio plait would reach with no overhead at all (no Python, no "
               "exposed communication) on today's kernels. With several ranks, rank 0's share counts its wait "
               "for a rank with more kernel work (dropless EP: more expert rows) as overhead, though no "
               "framework overhead removed could make the step shorter than that rank's kernels: the busiest "
               "rank's share (the largest of every rank's) is the tighter bound, and distance = 1 - share.\n")  # fmt: skip
    out.append("| config | mode | plait / torchtitan | kernel share rank 0 | bound | kernel share busiest rank "
               "| bound | target reachable with these kernels |")  # fmt: skip
    out.append("|---|---|---|---|---|---|---|---|")
    for name in CONFIGS:
        for mode in modes:
            p, t = runs.get(f"plait:{name}:{mode}"), runs.get(f"torchtitan:{name}:{mode}")
            s = profiles.get(f"plait:{name}:{mode}")
            if not s or not p or not t or p.median is None or t.median is None:
                continue
            share = kernel_ms(s) / s["step_ms"]
            busiest = max(s.get("rank_kernel_shares", [share]))
            bound, tight = p.median / t.median / share, p.median / t.median / busiest
            verdict = "yes" if tight >= TARGET else f"no: at most {tight:.2f}x"
            out.append(f"| {name} | {mode} | {_ratio(p, t)} | {share:.0%} | {bound:.2f}x | {busiest:.0%} | "
                       f"{tight:.2f}x | {verdict} |")  # fmt: skip
    out.append("")
    out.append("### Scaling on this machine (plait eager; 2 cores in all, ideal 1.0x)\n")
    out.append("| what | runs | tok/s | ratio |")
    out.append("|---|---|---|---|")
    scaling = [
        ("FSDP 1 -> 2 ranks, global batch 8 x 512", "llama3-fsdp2-gb8", "llama3-1"),
        ("TP 2 vs 1 rank, batch 8 x 512", "llama3-tp2", "llama3-1"),
        ("CP 2 all-gather vs 1 rank, seq 4096", "llama3-seq4096-cp2-allgather", "llama3-seq4096-1"),
        ("CP 2 ring vs 1 rank, seq 4096", "llama3-seq4096-cp2-ring", "llama3-seq4096-1"),
        ("EP 2 vs EP 1 (both FSDP 2), DeepSeek-V3", "deepseek-ep2", "deepseek-fsdp2"),
    ]
    for what, a, b in scaling:
        ra, rb = runs.get(f"plait:{a}:eager"), runs.get(f"plait:{b}:eager")
        if ra or rb:
            out.append(f"| {what} | {a} / {b} | {_tps(ra)} / {_tps(rb)} | {_ratio(ra, rb)} |")
    out.append("")
    comm = [(k, s) for k, s in profiles.items() if s["comm_total_ms"] > 0]
    if comm:
        out.append("Communication per step (rank 0): exposed = the training thread waiting in collectives; "
                   "total = time a collective was in flight (gloo's thread); peer late = the part of exposed "
                   "spent in a collective the other rank had not yet entered (`comm_skew.py`: no overlap "
                   "hides it, only evener work before the collective).\n")  # fmt: skip
        out.append("| config | mode | exposed ms | of it peer late | total ms | overlapped | exposed / step |")
        out.append("|---|---|---|---|---|---|---|")
        for key, s in comm:
            _, name, mode = key.split(":")
            exposed, total = s["communication_ms"], s["comm_total_ms"]
            hidden = 1 - exposed / total if total else 0.0
            late = f"{s['exposed_peer_late_ms']:.0f}" if "exposed_peer_late_ms" in s else "-"
            out.append(f"| {name} | {mode} | {exposed:.0f} | {late} | {total:.0f} | {max(hidden, 0):.0%} | "
                       f"{exposed / s['step_ms']:.0%} |")  # fmt: skip
        out.append("")
    syncs = {k: r.extra["host_syncs_per_step"] for k, r in runs.items() if "host_syncs_per_step" in r.extra}
    if syncs:
        out.append("MoE host syncs per step (plait): " + ", ".join(f"{k.split(':')[1]} {k.split(':')[2]} {v:g}"
                                                               for k, v in syncs.items()))  # fmt: skip
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", nargs="?", type=Path,
                        default=(REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer").resolve(),
                        help="torchtitan's test tokenizer folder (tokenizer.json)")  # fmt: skip
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=1, help="rounds, alternating which framework runs first")
    parser.add_argument("--only", help=f"comma-separated subset of {','.join(ALL)}")
    parser.add_argument("--skip-torchtitan", action="store_true")
    parser.add_argument("--no-compile", action="store_true", help="eager runs only")
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument("--no-results", action="store_true", help="do not append to benchmarks/RESULTS.md")
    parser.add_argument("--venv", type=Path, default=HERE / ".venv", help="torchtitan's venv if not importable here")
    parser.add_argument("--port", type=int, default=29571)
    args = parser.parse_args()
    args.names = args.only.split(",") if args.only else list(ALL)
    unknown = [n for n in args.names if n not in ALL]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {list(ALL)}")
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    use_tt = not args.skip_torchtitan and any(ALL[n].torchtitan for n in args.names)
    if use_tt and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"no tokenizer.json in {args.tokenizer}")
    python = None
    if use_tt:
        probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"],
                               capture_output=True, text=True)  # fmt: skip
        python = Path(sys.executable) if probe.stdout.strip() == TORCHTITAN_VERSION else ensure_torchtitan_venv(args.venv)

    started = time.time()
    print(f"[bench] {datetime.date.today()} {machine()}, torch {torch_version()}, commit {commit()}", flush=True)
    modes = [False] + ([] if args.no_compile else [True])
    runs: dict[str, Run] = {}
    profiles: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="plait-suite-") as tmp:
        workdir = Path(tmp)
        for round_ in range(args.rounds):
            for i, name in enumerate(args.names):
                config = ALL[name]
                sides = ["plait"] + (["torchtitan"] if config.torchtitan and use_tt else [])
                if config.torchtitan and not cpu_has_bf16_units():
                    sides.append("plait-route")  # the route's gain: a row of its own
                if (i + round_) % 2:  # alternate who goes first
                    sides.reverse()
                for compile in modes if config.torchtitan else [False]:
                    mode = "compile" if compile else "eager"
                    for side in sides:
                        key = f"{side}:{name}:{mode}"
                        tag = f"{side}-{name}-{mode}-r{round_}"
                        t0 = time.time()
                        if side == "plait":
                            run = run_plait(config, workdir, tag, args.steps, args.warmup, compile)
                        elif side == "plait-route":
                            run = run_plait(config, workdir, tag, args.steps, args.warmup, compile, cpu_bf16="auto")
                        else:
                            run = run_torchtitan(python, config, workdir, tag, args, compile)
                        _merge(runs.setdefault(key, Run()), run)
                        print(f"[bench] {key}: {_tps(run)} tok/s, peak {run.peak_gib:.2f} GiB "
                              f"({time.time() - t0:.0f} s)", flush=True)  # fmt: skip
        if not args.no_profile:
            for name in args.names:
                for compile in modes if ALL[name].torchtitan else []:
                    mode = "compile" if compile else "eager"
                    summary = profile_plait(ALL[name], workdir, f"{name}-{mode}", compile, at=args.warmup + 2)
                    if summary:
                        profiles[f"plait:{name}:{mode}"] = summary
                        print(f"[bench] profile {name} {mode}: step {summary['step_ms']:.0f} ms, kernels "
                              f"{kernel_ms(summary):.0f} ms", flush=True)  # fmt: skip
    text = report(args, runs, profiles)
    raw = {k: {"tps": r.tps, "per_round": r.per_round, "peak_gib": r.peak_gib, "error": r.error, **r.extra}
           for k, r in runs.items()}
    (HERE / ".last_suite.json").write_text(json.dumps({"runs": raw, "profiles": profiles}, indent=1))
    header = (f"## Benchmark suite, {datetime.date.today()} (`nox -s bench`, `benchmarks/suite.py`)\n\n"
              f"{machine()}; torch {torch_version()}; torchtitan {TORCHTITAN_VERSION}; commit {commit()}; "
              f"{args.steps} steps, {args.warmup} warmup, {args.rounds} round(s); "
              f"{(time.time() - started) / 60:.0f} min.\n")  # fmt: skip
    if not args.no_results:  # the plait runs' tokens/s per layout, as bars beside the tables
        from layout_figure import draw_tokens_per_second

        name = f"figures/bench_layouts-{datetime.date.today()}.png"
        medians = {k: r.median for k, r in runs.items() if not r.error}
        if draw_tokens_per_second(medians, HERE / name, f"plait tokens/s per layout, {machine()}"):
            text += f"\n![plait tokens/s per layout]({name})\n"
    print("\n" + header + "\n" + text)
    if not args.no_results:
        results = HERE / "RESULTS.md"
        body = results.read_text()
        title, _, rest = body.partition("\n")
        results.write_text(f"{title}\n\n{header}\n{text}\n{rest}")
        print(f"[bench] appended to {results}")


if __name__ == "__main__":
    main()
