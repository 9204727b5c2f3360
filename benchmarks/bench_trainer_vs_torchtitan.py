"""plait-train vs torchtitan 0.3.0: training tokens/s on the same CPU configuration.

    python benchmarks/bench_trainer_vs_torchtitan.py [--steps 12] [--warmup 2] [--repeats 1]
        [--compile off|on|both] [--only plait|torchtitan] [TOKENIZER_DIR]

Both train the Llama 3 debug model (6 layers, dim 256, 16 heads, vocab 2048) for the same number
of steps in one process on CPU: seq_len 512, local batch 8, bf16 compute with fp32 master weights
(plait: autocast; torchtitan: its FSDP mixed-precision policy, which it installs even on one
rank), no activation checkpointing, causal SDPA attention, on the text of plait's built-in
corpus. Each framework runs without compile (its default) and, with `--compile on|both`
(default both), with torch.compile per block and on the loss (plait `--training.compile true`,
torchtitan `--compile.enable`). The first `--warmup` steps are excluded; the script prints each
run's median tokens/s over the remaining steps (of all `--repeats` rounds, which alternate the
order of the runs so a shared machine's drifting load hits all alike), the best step, the
per-round medians, and the ratios of the medians: eager vs eager, plait compile vs torchtitan
default, compile vs compile (with the range of the per-round ratios).

* plait runs through `plait-train` (a subprocess); tokens/s is read from
  `<dump_folder>/metrics.jsonl` (key `tokens_per_second`, one line per step with log_freq 1).
* torchtitan runs from a separate virtual environment (default `benchmarks/.venv`, git-ignored),
  created on first use with `--system-site-packages` and `pip install torchtitan==0.3.0` under the
  constraint `torch==<this interpreter's torch>` (2.13.0), so torch is never upgraded or replaced.
  It is launched through `torchtitan_cpu.py`, which patches torchtitan (only) to run on CPU, and
  its tokens/s is parsed from its per-step log lines (`tps:`). torchtitan's tokenizer is the
  test tokenizer at TOKENIZER_DIR (default: ../shared/bench/torchtitan-tokenizer relative to the
  repository root).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TORCHTITAN_VERSION = "0.3.0"
CORPUS_DIR = REPO / "packages" / "trainer" / "src" / "plait" / "trainer" / "assets" / "corpus"
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TT_STEP = re.compile(r"step:\s*(\d+)\s.*?tps:\s*([\d,]+)")


def torch_version() -> str:
    import torch

    return torch.__version__.split("+")[0]


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_torchtitan_venv(venv: Path) -> Path:
    """A venv with torchtitan==0.3.0 that reuses this interpreter's torch (pinned)."""
    python = venv_python(venv)
    check = [str(python), "-c", "import torchtitan, torch, importlib.metadata as m; "
             "print(m.version('torchtitan'), torch.__version__.split('+')[0])"]
    if python.exists():
        out = subprocess.run(check, capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.split() == [TORCHTITAN_VERSION, torch_version()]:
            return python
    print(f"[bench] creating {venv} with torchtitan=={TORCHTITAN_VERSION}, torch=={torch_version()} pinned",
          flush=True)
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(f"torch=={torch_version()}\n")
        constraints = f.name
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", "-c", constraints,
                    f"torchtitan=={TORCHTITAN_VERSION}"], check=True)
    os.unlink(constraints)
    out = subprocess.run(check, capture_output=True, text=True, check=True)
    if out.stdout.split() != [TORCHTITAN_VERSION, torch_version()]:
        raise RuntimeError(f"venv {venv} has (torchtitan, torch) = {out.stdout.split()}")
    return python


def run_torchtitan(args, python: Path, workdir: Path, compile: bool) -> list[tuple[int, float]]:
    name = "torchtitan-compile" if compile else "torchtitan"
    dump = workdir / name
    cmd = [
        str(python), str(HERE / "torchtitan_cpu.py"),
        "--module", "llama3", "--config", "llama3_debugmodel",
        "--hf_assets_path", str(args.tokenizer),
        "--dataloader.dataset_path", str(CORPUS_DIR),
        "--dump_folder", str(dump),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--training.steps", str(args.steps),
        "--training.mixed_precision_param", "bfloat16" if args.dtype == "bfloat16" else "float32",
        "--metrics.log_freq", "1",
        *(["--compile.enable"] if compile else []),
        "activation_checkpoint:none",
    ]
    env = dict(os.environ, WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), PYTHONUNBUFFERED="1")
    log = workdir / f"{name}.log"
    print(f"[bench] torchtitan: {' '.join(cmd)}\n[bench] log: {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    text = _ANSI.sub("", log.read_text())
    if proc.returncode != 0:
        sys.exit(f"[bench] torchtitan failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(text.splitlines()[-25:]))
    return [(int(m.group(1)), float(m.group(2).replace(",", ""))) for m in _TT_STEP.finditer(text)]


def plait_records(train_args: list[str], workdir: Path, name: str) -> list[dict]:
    """Run plait-train with `train_args` (dump folder `workdir/name`); its metrics.jsonl rows."""
    dump = workdir / name
    exe = shutil.which("plait-train")
    cmd = [exe] if exe else [sys.executable, "-m", "plait.trainer"]
    cmd += ["--job.dump_folder", str(dump), *train_args]
    log = workdir / f"{name}.log"
    print(f"[bench] {name}: {' '.join(cmd)}\n[bench] log: {log}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=workdir,
                              env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        sys.exit(f"[bench] {name} failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(log.read_text().splitlines()[-25:]))
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "tokens_per_second" in row]


def run_plait(args, workdir: Path, compile: bool) -> list[tuple[int, float]]:
    records = plait_records([
        "--config", "llama3_debugmodel.toml",
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--training.dtype", args.dtype,
        "--training.steps", str(args.steps),
        "--training.activation_checkpoint", "none",
        "--training.compile", "true" if compile else "false",
        "--metrics.log_freq", "1",
        "--metrics.tensorboard", "false",
    ], workdir, "plait-compile" if compile else "plait")
    return [(int(r.get("step", i + 1)), float(r["tokens_per_second"])) for i, r in enumerate(records)]


def after_warmup(name: str, steps: list[tuple[int, float]], warmup: int) -> list[float]:
    kept = [tps for step, tps in steps if step > warmup]
    if not kept:
        sys.exit(f"[bench] {name}: no step after the {warmup} warmup steps was logged ({steps})")
    print(f"[bench] {name}: tokens/s per step {[round(t) for _, t in steps]}; "
          f"median over steps {warmup + 1}..{max(s for s, _ in steps)}: {statistics.median(kept):.0f}",
          flush=True)
    return kept


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", nargs="?", type=Path,
                        default=(REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer").resolve(),
                        help="torchtitan's test tokenizer folder (tokenizer.json)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--venv", type=Path, default=HERE / ".venv", help="torchtitan's venv")
    parser.add_argument("--only", choices=["plait", "torchtitan"], help="run one side only")
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the two runs this many times (a shared machine's load drifts); "
                             "the median is over all kept steps of all repeats")
    parser.add_argument("--compile", choices=["off", "on", "both"], default="both",
                        help="torch.compile per block (plait --training.compile, torchtitan --compile.enable): "
                             "run each framework without it, with it, or both")
    parser.add_argument("--port", type=int, default=29531, help="torchtitan's MASTER_PORT")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    if args.only != "plait" and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"no tokenizer.json in {args.tokenizer}")

    import torch

    print(f"[bench] {time.strftime('%Y-%m-%d')} torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{torch.get_num_threads()} torch threads; Llama 3 debugmodel, seq {args.seq_len}, "
          f"batch {args.batch}, {args.dtype}, {args.steps} steps ({args.warmup} warmup)", flush=True)
    compiles = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    sides = [(fw, c) for fw in ("plait", "torchtitan") if args.only in (None, fw) for c in compiles]
    python = ensure_torchtitan_venv(args.venv) if args.only != "plait" else None
    kept: dict[str, list[float]] = {}
    per_round: dict[str, list[float]] = {}
    for repeat in range(1, args.repeats + 1):
        # Alternate the order every round, so a shared machine's drifting load hits every side alike.
        order = sides if repeat % 2 else sides[::-1]
        print(f"[bench] round {repeat}/{args.repeats}", flush=True)
        with tempfile.TemporaryDirectory(prefix="plait-bench-") as tmp:
            workdir = Path(tmp)
            for framework, compile in order:
                name = framework + ("-compile" if compile else "")
                if framework == "plait":
                    steps = run_plait(args, workdir, compile)
                else:
                    steps = run_torchtitan(args, python, workdir, compile)
                values = after_warmup(name, steps, args.warmup)
                kept.setdefault(name, []).extend(values)
                per_round.setdefault(name, []).append(statistics.median(values))
    results = {name: statistics.median(values) for name, values in kept.items()}
    print()
    print(f"{'run':<20}{'median tok/s':>13}{'best':>8}{'steps':>7}   per-round medians")
    for name, tps in results.items():
        rounds = ", ".join(f"{r:.0f}" for r in per_round[name])
        print(f"{name:<20}{tps:>13.0f}{max(kept[name]):>8.0f}{len(kept[name]):>7}   {rounds}")
    pairs = [("plait", "torchtitan", "eager vs eager"),
             ("plait-compile", "torchtitan", "plait compile vs torchtitan default"),
             ("plait-compile", "torchtitan-compile", "compile vs compile"),
             ("plait-compile", "plait", "plait compile vs plait eager"),
             ("torchtitan-compile", "torchtitan", "torchtitan compile vs torchtitan eager")]
    for a, b, what in pairs:
        if a in results and b in results:
            low = min(x / y for x, y in zip(per_round[a], per_round[b]))
            high = max(x / y for x, y in zip(per_round[a], per_round[b]))
            print(f"ratio {a} / {b} ({what}): {results[a] / results[b]:.2f} "
                  f"(per-round {low:.2f}-{high:.2f})")


if __name__ == "__main__":
    main()
