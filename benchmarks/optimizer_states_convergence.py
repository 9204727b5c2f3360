"""bf16 optimizer states against fp32 ones (issue 54 item 2): 300 steps of both debug models, and
the optimizer step's time, on this CPU.

    python benchmarks/optimizer_states_convergence.py                      # 300 steps; figures + RESULTS.md
    python benchmarks/optimizer_states_convergence.py --steps 10 --no-results   # a smoke test

Every run: plait-train on one rank, the shipped corpus, a debug model with 2 layers, seq 32, local
batch 2, lr 1e-3, fp32 compute (so the moments' dtype is the only difference), `job.seed` 0; one
with `optimizer.state_dtype fp32` (torch's fused AdamW), one with `bf16`. int8 is refused by
plait-train (optimizer.py says why), so it has no curve. Each run is a subprocess pinned to a core
of its own (taskset) with OMP_NUM_THREADS=1, two at once.

Reported per model: the mean loss of the last 50 steps, the final loss, and max over steps of
|loss_bf16 - loss_fp32|; a figure per model by plait-plot's `draw`. The step time: the debug
model's full flavor (every parameter of it), gradients of ones, the median of 20 steps after 3
warm-up steps, one thread: fused and foreach fp32 against bf16.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import torch_version  # noqa: E402
from lease_table import prepend  # noqa: E402
from suite import commit, machine  # noqa: E402

from plait.trainer.plot import draw  # noqa: E402

MEAN_OF_LAST = 50
MODELS = ("llama3", "deepseek_v3")
STATE_DTYPES = ("fp32", "bf16")
# fmt: off
SHAPE = ["--model.n_layers", "2", "--training.seq_len", "32", "--training.local_batch_size", "2",
         "--training.dtype", "float32", "--optimizer.lr", "1e-3", "--metrics.log_freq", "50",
         "--metrics.tensorboard", "false", "--metrics.progress_bar", "false"]
# fmt: on


def _train(dump: Path, model: str, state_dtype: str, steps: int, core: int) -> None:
    args = ["--job.dump_folder", str(dump), *SHAPE, "--model.name", model, "--optimizer.state_dtype", state_dtype,
            "--training.steps", str(steps)]  # fmt: skip
    pin = ["taskset", "-c", str(core)] if shutil.which("taskset") else []
    log = dump.with_suffix(".log")
    started = time.time()
    with open(log, "w") as f:
        proc = subprocess.run([*pin, sys.executable, "-m", "plait.trainer", *args], stdout=f, stderr=subprocess.STDOUT,
                              env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))  # fmt: skip
    if proc.returncode != 0:
        sys.exit(f"[bench] {dump.name} failed (exit {proc.returncode}); see {log}")
    print(f"[bench] {dump.name}: {time.time() - started:.0f} s", flush=True)


def losses(dump: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def train_all(workdir: Path, steps: int) -> dict[tuple[str, str], Path]:
    runs = {(m, s): workdir / f"{m}-{s}" for m in MODELS for s in STATE_DTYPES}
    cores = sorted(os.sched_getaffinity(0))[:2]
    with ThreadPoolExecutor(max_workers=len(cores)) as pool:
        for i in range(0, len(runs), len(cores)):
            batch = list(runs.items())[i : i + len(cores)]
            list(pool.map(lambda item: _train(item[1][1], *item[1][0], steps, cores[item[0]]), enumerate(batch)))
    return runs


def step_times() -> dict[str, dict[str, float]]:
    """Milliseconds per optimizer step on the debug flavor's parameters: {model: {kind: ms}}."""
    import torch

    from plait.trainer.config import build_config
    from plait.trainer.model_args import model_spec, resolve_model_args
    from plait.trainer.optimizer import build_optimizer

    torch.set_num_threads(1)
    out = {}
    for name in MODELS:
        config = build_config(None, [("model.name", name)])
        spec = model_spec(config)
        model = spec.model_cls(resolve_model_args(config, spec))
        numel = sum(p.numel() for p in model.parameters())
        out[name] = {"parameters": numel}
        for kind, overrides in (("fp32 fused", {"implementation": "fused"}), ("fp32 foreach", {"implementation": "foreach"}),
                                ("bf16", {"state_dtype": "bf16"})):  # fmt: skip
            for key, value in {"implementation": "auto", "state_dtype": "fp32", **overrides}.items():
                setattr(config.optimizer, key, value)
            opt = build_optimizer(model, config.optimizer, torch.device("cpu"))
            for p in model.parameters():
                p.grad = torch.ones_like(p)
            samples = []
            for _ in range(23):
                t0 = time.perf_counter()
                opt.step()
                samples.append(time.perf_counter() - t0)
            out[name][kind] = 1e3 * statistics.median(samples[3:])
    return out


def section(runs: dict, times: dict, figures: Path, steps: int, link_from: Path, minutes: float) -> str:
    lines = [
        f"## Optimizer states: bf16 vs fp32 moments, {datetime.date.today()} (issue 54 item 2; "
        "`benchmarks/optimizer_states_convergence.py`)",
        "",
        f"{machine()}; torch {torch_version()}; commit {commit()}; {steps} steps per run, one rank, one thread "
        f"each (two at once); {minutes:.0f} min.",
        "",
        "Debug models, 2 layers, seq 32, local batch 2, lr 1e-3, fp32 compute, the shipped corpus; "
        "`--optimizer.state_dtype fp32` (torch's fused AdamW) against `bf16` (plait's AdamW, bf16 moments "
        "with layout-invariant stochastic rounding). int8 is refused (which shards torchao keeps in 8 bits "
        "follows the layout: below). Figures drawn by `plait-plot`'s `draw`.",
        "",
        f"| model | state dtype | mean loss, last {min(MEAN_OF_LAST, steps)} steps | final loss | "
        "max over steps of \\|Δloss\\| vs fp32 |",
        "|---|---|---|---|---|",
    ]
    links = []
    for model in MODELS:
        base = losses(runs[(model, "fp32")])
        for dtype in STATE_DTYPES:
            curve = losses(runs[(model, dtype)])
            last = [curve[s] for s in sorted(curve)[-MEAN_OF_LAST:]]
            diff = max(abs(curve[s] - base[s]) for s in curve) if dtype != "fp32" else 0.0
            lines.append(f"| {model} | {dtype} | {statistics.fmean(last):.4f} | {curve[max(curve)]:.4f} | "
                         f"{'-' if dtype == 'fp32' else f'{diff:.2e}'} |")  # fmt: skip
        figure = figures / f"optimizer_states_{model}.png"
        draw([runs[(model, d)] for d in STATE_DTYPES], figure, labels=[f"{d} moments" for d in STATE_DTYPES],
             series=["loss", "grad_norm"], title=f"bf16 vs fp32 AdamW moments, {model} debug: {steps} steps")  # fmt: skip
        links.append(f"![optimizer_states_{model}]({os.path.relpath(figure, link_from)})")
    lines += ["", "Optimizer step, ms (debug flavor, all its parameters, one thread, median of 20):", "",
              "| model | parameters | fp32 fused | fp32 foreach | bf16 | bf16 / fused |", "|---|---|---|---|---|---|"]
    for model, t in times.items():
        lines.append(f"| {model} | {t['parameters'] / 1e6:.1f} M | {t['fp32 fused']:.1f} | {t['fp32 foreach']:.1f} | "
                     f"{t['bf16']:.1f} | {t['bf16'] / t['fp32 fused']:.1f}x |")  # fmt: skip
    return "\n".join([*lines, "", *links, ""])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--results", type=Path, default=HERE / "RESULTS.md", help="put the section in this file")
    parser.add_argument("--no-results", action="store_true", help="write no section (figures go to --workdir)")
    parser.add_argument("--workdir", type=Path, help="run folders (default: a new temporary folder, kept)")
    args = parser.parse_args()
    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="plait-optimizer-states-"))
    workdir.mkdir(parents=True, exist_ok=True)
    figures = workdir / "figures" if args.no_results else HERE / "figures"
    print(f"[bench] {machine()}, torch {torch_version()}, commit {commit()}; runs in {workdir}", flush=True)
    started = time.time()
    runs = train_all(workdir, args.steps)
    times = step_times()
    text = section(runs, times, figures, args.steps, args.results.resolve().parent, (time.time() - started) / 60)
    print("\n" + text)
    if not args.no_results:
        prepend(args.results, text)
        print(f"[bench] added to {args.results}")


if __name__ == "__main__":
    main()
