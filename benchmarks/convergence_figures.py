"""Convergence figures (issue 55): float8 against bf16 and multi-token prediction against none,
trained with plait-train on this CPU and drawn with plait-plot.

    python benchmarks/convergence_figures.py                      # 300 steps; figures + RESULTS.md
    python benchmarks/convergence_figures.py --steps 10 --no-results   # a smoke test

Every run: a debug model with 2 layers, seq 32, local batch 2, lr 1e-3, bf16: the settings of
`test_float8_acts_and_trains_near_bf16` (packages/trainer/tests/test_trainer_float8.py), which runs
fewer steps (and DeepSeek-V3 with narrower attention); this is the issue's 300-step comparison.

- float8_llama3: Llama 3, bf16 vs float8 tensorwise (float8_filter divisible: every linear of a
  debug model; torchao's CPU emulation).
- float8_deepseek_v3: DeepSeek-V3, bf16 vs float8 tensorwise with the routed experts in MXFP8.
- mtp_deepseek_v3: DeepSeek-V3, no MTP vs `--model.mtp_layers 1` (the main loss, metrics.jsonl's
  `loss`, compared; the depth's own loss is a panel of its own). Its baseline is the same run as
  float8_deepseek_v3's bf16 one, trained once.

Each run is a `python -m plait.trainer` subprocess pinned to one core by taskset (plait-train sizes
its thread pool from the cores it may use, whatever OMP_NUM_THREADS says: one thread), with
OMP_NUM_THREADS=1; `--jobs` runs go at once, each on a core of its own.
Figures: `<figures>/<name>.png` (plait.trainer.plot.draw). With results on, a dated section (machine,
torch, torchao, commit) with the mean loss of each run's last 50 steps, the difference from the
comparison's first run, and links to the figures is put right below RESULTS.md's title, newest
first (as suite.py does). Run folders (metrics.jsonl, log) stay under `--workdir` to redraw.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import torch_version  # noqa: E402
from suite import commit, machine  # noqa: E402

from plait.trainer.plot import draw  # noqa: E402

MEAN_OF_LAST = 50
# fmt: off
SHAPE = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--optimizer.lr", "1e-3", "--metrics.log_freq", "50", "--metrics.tensorboard", "false",
         "--metrics.progress_bar", "false"]
BF16 = ["--training.dtype", "bfloat16"]
FLOAT8 = [*BF16, "--training.float8", "tensorwise", "--training.float8_filter", "divisible"]  # the test's FLOAT8
MXFP8_EXPERTS = ["--training.float8_experts", "mxfp8"]
LLAMA, DEEPSEEK = ["--model.name", "llama3"], ["--model.name", "deepseek_v3"]
# fmt: on


@dataclass(frozen=True)
class Comparison:
    name: str  # the figure's file name
    title: str
    runs: dict[str, list[str]]  # label -> plait-train arguments (besides SHAPE); the first is the baseline
    series: list[str]  # plait-plot's panels


COMPARISONS = [
    Comparison("float8_llama3", "float8 vs bf16, Llama 3 debug",
               {"bf16": [*LLAMA, *BF16], "float8 tensorwise": [*LLAMA, *FLOAT8]}, ["loss", "grad_norm"]),
    Comparison("float8_deepseek_v3", "float8 vs bf16, DeepSeek-V3 debug",
               {"bf16": [*DEEPSEEK, *BF16], "float8 tensorwise + MXFP8 experts": [*DEEPSEEK, *FLOAT8, *MXFP8_EXPERTS]},
               ["loss", "grad_norm", "moe_imbalance"]),
    Comparison("mtp_deepseek_v3", "multi-token prediction vs none, DeepSeek-V3 debug",
               {"no MTP": [*DEEPSEEK, *BF16], "MTP": [*DEEPSEEK, *BF16, "--model.mtp_layers", "1"]},
               ["loss", "mtp_loss", "grad_norm", "moe_imbalance"]),
]  # fmt: skip


def _train(dump: Path, args: list[str], steps: int, cores: queue.Queue) -> None:
    """One plait-train run on a core of its own; exits with the log's tail if it fails."""
    core = cores.get()
    train = ["--job.dump_folder", str(dump), *SHAPE, *args, "--training.steps", str(steps)]
    # taskset, not preexec_fn (unsafe in a process with threads, which this one has).
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    log = dump.with_suffix(".log")
    print(f"[bench] {dump.name} (core {core}): plait-train {' '.join(train)}", flush=True)
    started = time.time()
    try:
        with open(log, "w") as f:
            proc = subprocess.run([*pin, sys.executable, "-m", "plait.trainer", *train], stdout=f,
                                  stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # fmt: skip
    finally:
        cores.put(core)
    if proc.returncode != 0:
        sys.exit(f"[bench] {dump.name} failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-25:]))  # fmt: skip
    print(f"[bench] {dump.name}: {time.time() - started:.0f} s", flush=True)


def train_all(workdir: Path, steps: int, jobs: int) -> dict[tuple[str, ...], Path]:
    """Every distinct run of COMPARISONS, trained once: {arguments: dump folder}."""
    dumps: dict[tuple[str, ...], Path] = {}
    for comparison in COMPARISONS:
        for label, args in comparison.runs.items():
            slug = "".join(c if c.isalnum() else "_" for c in label)
            dumps.setdefault(tuple(args), workdir / f"{comparison.name}-{slug}")
    usable = sorted(os.sched_getaffinity(0))
    cores: queue.Queue = queue.Queue()
    for core in usable[: max(1, jobs)]:
        cores.put(core)
    with ThreadPoolExecutor(max_workers=cores.qsize()) as pool:
        for future in [pool.submit(_train, dump, list(args), steps, cores) for args, dump in dumps.items()]:
            future.result()
    return dumps


def mean_last_losses(dump: Path) -> tuple[float, int, int]:
    """The mean training loss of the run's last MEAN_OF_LAST steps, and those steps' first and last."""
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    kept = [row for row in rows if "loss" in row][-MEAN_OF_LAST:]
    return statistics.fmean(row["loss"] for row in kept), kept[0]["step"], kept[-1]["step"]


def figures_and_table(dumps: dict, figures: Path, steps: int, link_from: Path) -> list[str]:
    """Each comparison's figure, and the markdown table of its runs (figure links relative to `link_from`)."""
    lines = [f"| comparison | run | mean loss, last {min(MEAN_OF_LAST, steps)} steps | vs the first run |",
             "|---|---|---|---|"]  # fmt: skip
    links = []
    for comparison in COMPARISONS:
        runs = [dumps[tuple(args)] for args in comparison.runs.values()]
        figure = figures / f"{comparison.name}.png"
        draw(runs, figure, labels=list(comparison.runs), series=comparison.series,
             title=f"{comparison.title}: {steps} steps")  # fmt: skip
        print(f"[bench] figure {figure}", flush=True)
        base = None
        for label, dump in zip(comparison.runs, runs):
            mean, first, last = mean_last_losses(dump)
            versus = "-" if base is None else f"{100 * (mean - base) / base:+.3f} %"
            base = mean if base is None else base
            lines.append(f"| {comparison.title} | {label} | {mean:.4f} (steps {first}-{last}) | {versus} |")
        links.append(f"![{comparison.name}]({os.path.relpath(figure, link_from)})")
    return lines + [""] + links


def section(table: list[str], steps: int, jobs: int, minutes: float) -> str:
    try:
        torchao = importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        torchao = "not installed"
    return "\n".join([
        f"## Convergence: float8 vs bf16, multi-token prediction vs none, {datetime.date.today()} "
        "(issue 55; `benchmarks/convergence_figures.py`)",
        "",
        f"{machine()}; torch {torch_version()}; torchao {torchao}; commit {commit()}; {steps} steps per run, "
        f"each on one core with one thread ({jobs} at once); {minutes:.0f} min.",
        "",
        "Debug models, 2 layers, seq 32, local batch 2, lr 1e-3, bf16 (the settings of "
        "`test_float8_acts_and_trains_near_bf16`, at 300 steps); float8: tensorwise, `float8_filter divisible`, "
        "torchao's CPU emulation; DeepSeek-V3's float8 run has its routed experts in MXFP8 too. The MTP "
        "run's loss is its main loss (the depth's loss is its own panel); its baseline is the bf16 "
        "DeepSeek-V3 run. Figures drawn by `plait-plot`'s `draw`.",
        "",
        *table,
        "",
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once, each pinned to a core of its own")
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="put the section in this file")
    parser.add_argument("--no-results", action="store_true", help="write no section (figures go to --workdir)")
    parser.add_argument("--figures", type=Path, help="the figures' folder (default: benchmarks/figures, or "
                        "<workdir>/figures with --no-results)")  # fmt: skip
    parser.add_argument("--workdir", type=Path, help="run folders (default: a new temporary folder, kept)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="plait-convergence-"))
    workdir.mkdir(parents=True, exist_ok=True)
    figures = args.figures or (workdir / "figures" if args.no_results else HERE / "figures")
    print(f"[bench] {datetime.date.today()} {machine()}, torch {torch_version()}, commit {commit()}; "
          f"runs in {workdir}", flush=True)  # fmt: skip
    started = time.time()
    dumps = train_all(workdir, args.steps, args.jobs)
    table = figures_and_table(dumps, figures, args.steps, args.results.resolve().parent)
    text = section(table, args.steps, min(args.jobs, len(os.sched_getaffinity(0))), (time.time() - started) / 60)
    print("\n" + text)
    if not args.no_results:
        title, _, rest = args.results.read_text().partition("\n")
        args.results.write_text(f"{title}\n\n{text}{rest}")
        print(f"[bench] added to {args.results}")


if __name__ == "__main__":
    main()
