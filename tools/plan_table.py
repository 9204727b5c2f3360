"""The README's table of the shipped configs planned by plait-plan on H100 80 GB at their own layouts.

    python tools/plan_table.py                      plan each config (a subprocess each) and print the table
    python tools/plan_table.py --readme README.md   and put it between the README's markers
    python tools/plan_table.py --only llama3_8B     one config (printing only)

Each config runs at the world size it is written for (the same counts as the memory-estimate
test, packages/trainer/tests/test_trainer_memory_estimate.py), with its own degrees, micro-batch
and AC mode; the tokenizer is the shipped one (the configs name files a clone does not have; only
the vocabulary size matters to a plan). Tokens per GPU per step are the global batch's tokens over
the world (plait-plan's count); beside them, the same at the micro-batch and AC mode each config
shipped with at BASELINE_COMMIT, before `plait-plan --plan.max_batch` set them (issue 54; BEFORE,
copied from that commit's configs so that a clone without the history prints them too; every other
setting of those configs is today's). Pipeline-parallel configs are traced stage by stage (rank 0's
stages); a config the planner cannot trace gets a row saying so instead of failing the table.
Nobody types these numbers but BEFORE's.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from parity_table import write_readme  # tools/ is on sys.path when this script runs

ROOT = Path(__file__).resolve().parent.parent
START, END = "<!-- plan-table:start -->", "<!-- plan-table:end -->"
GIB = 2**30
BASELINE_COMMIT = "f8aade2"  # the shipped configs before issue 54's batch search
# config -> (training.local_batch_size, training.activation_checkpoint) at BASELINE_COMMIT
# (`git show f8aade2:packages/trainer/src/plait/trainer/configs/NAME.toml`)
BEFORE = {
    "llama3_8B": (1, "selective"), "llama3_8B_64k_cp": (1, "full"), "llama3_70B": (8, "full"),
    "llama3_405B": (16, "full"), "deepseek_v3_16B": (2, "selective"), "deepseek_v3_236B": (4, "full"),
    "deepseek_v3_671B": (16, "full"),
}
# config -> ranks it is written for
CONFIGS = {
    "llama3_8B": 8, "llama3_8B_64k_cp": 8, "llama3_70B": 64, "llama3_405B": 512,
    "deepseek_v3_16B": 8, "deepseek_v3_236B": 256, "deepseek_v3_671B": 512, "kimi_k2": 512,
    "qwen3_8B": 8, "qwen3_30B_A3B": 16, "qwen3_235B_A22B": 256,
}
KINDS = {"Parameter": "parameters", "Gradient": "gradients", "Optstate": "optimizer state", "Activation": "activations",
         "Temp": "temporaries", "Buffer": "buffers", "Other": "other"}


def _cpu_flags(name: str) -> tuple[list[str], list[str]]:
    """Flags that let a CPU plan a GPU-only setting, and the notes saying so: async TP (symmetric
    memory, GPU-only, refused on CPU by validation) is planned as the same TP without it."""
    from plait.trainer.config import load_toml

    flags, notes = [], []
    if load_toml(f"{name}.toml").get("parallelism", {}).get("async_tp"):
        flags += ["--parallelism.async_tp", "false"]
        notes.append("async TP planned as TP")
    return flags, notes


def plan(name: str, world: int) -> dict:
    """plait-plan's JSON for one config, or {"error": first line} when it cannot be planned."""
    flags, notes = _cpu_flags(name)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        start = time.monotonic()
        result = subprocess.run(
            [sys.executable, "-m", "plait.plan.cli", "--config", f"{name}.toml", "--plan.world_size",
             str(world), "--plan.device", "h100", "--model.tokenizer_path", "", "--job.dump_folder", tmp,
             "--plan.json", str(out), *flags],
            capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=1800,
        )  # fmt: skip
        seconds = time.monotonic() - start
        if result.returncode or not out.exists():
            lines = [x for x in result.stderr.strip().splitlines() if x.strip()]
            errors = [x for x in lines if "error" in x.lower()] or lines or ["no output"]
            return {"error": errors[-1].strip()[:300], "seconds": seconds, "notes": notes}
        report = json.loads(out.read_text())
    report["seconds"], report["notes"] = seconds, notes
    return report


def tokens_per_gpu(report: dict, local_batch: int | None = None) -> float:
    """Tokens per GPU per step of the planned config, or of the same at another local batch."""
    from plait.plan.report import tokens_per_gpu_per_step

    b, s = report["micro_batch"]
    layout = report["layout"]
    return tokens_per_gpu_per_step(local_batch or b, s, report["gradient_accumulation_steps"],
                                   layout["dp_replicate"] * layout["dp_shard"], layout["world_size"])


def _before(name: str, report: dict) -> str:
    """The BASELINE_COMMIT cell: its micro-batch and AC mode, and their tokens per GPU per step."""
    if name not in BEFORE:
        return "-"
    batch, ac = BEFORE[name]
    return f"{tokens_per_gpu(report, batch):,.0f} ({batch}, {ac})"


def _layout(layout: dict) -> str:
    names = ("pp", "dp_replicate", "dp_shard", "cp", "tp", "ep", "etp")
    return " x ".join(f"{k} {layout[k]}" for k in names if layout.get(k) not in (None, 1)) or "one rank"


def _dominant(report: dict) -> str:
    m = report["memory"]
    parts = sorted(((v, k) for k, v in m["peak_parts"].items() if v), reverse=True)
    total = sum(v for v, _ in parts) or 1
    top = ", ".join(f"{KINDS.get(k, k)} {v / GIB:.1f} ({100 * v / total:.0f}%)" for v, k in parts[:2])
    module = m["peak_at"]["module"] or "the step"
    where = module.strip("()") if module.startswith("(") else f"in {module}"
    return f"{top}; {where} ({m['peak_at']['phase']})"


def _comm(report: dict) -> str:
    comm = report["communication"]
    if not comm:
        return "none"
    total = sum(c["bytes"] for c in comm)
    biggest = max(comm, key=lambda c: c["bytes"])
    return (f"{total / GIB:.1f} GiB ({biggest['axis']} {biggest['kind']} {biggest['bytes'] / GIB:.1f}); "
            f"{report['communication_seconds'] * 1e3:.0f} ms")


def render(rows: list[tuple[str, int, dict]], commit: str) -> str:
    head = ["config", "ranks", "layout", "micro-batch x accumulation, AC", "tokens / GPU / step",
            f"tokens / GPU / step before ({BASELINE_COMMIT}'s micro-batch, AC)", "peak / rank (GiB)",
            "what dominates the peak (GiB at the peak)", "model state / rank (GiB)", "comm / step (largest); ideal comm time",
            "fits H100 80 GB (67.1 GiB usable)"]  # fmt: skip
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, world, r in rows:
        if "error" in r:
            note = r["error"].removeprefix("plait-plan: error: ")
            if "pipeline stages" in note:
                note = f"pp: not traced yet ({note})"
            lines.append(f"| {name} | {world} | | | | | | {note} | | | not planned |")
            continue
        m = r["memory"]
        b, s = r["micro_batch"]
        state = (m["parameters"] + m["gradients"] + m["optimizer"]) / GIB
        lines.append(
            f"| {name} | {world} | {_layout(r['layout'])}{''.join(f' ({n})' for n in r['notes'])} | {b} x {s} x {r['gradient_accumulation_steps']}, "
            f"{r['activation_checkpoint']} | {tokens_per_gpu(r):,.0f} | {_before(name, r)} | {m['peak'] / GIB:.1f} | {_dominant(r)} | {state:.1f} | {_comm(r)} | "
            f"{'yes' if r['fits'] else '**no**'} |"
        )
    seconds = sum(r.get("seconds", 0) for _, _, r in rows)
    lines += ["", (
        f"Per rank, traced by `plait-plan` (rank 0 of the real step under a fake process group of the full world; "
        "peak of a step after the first (AdamW's state alive); memory is what tensors hold: no CUDA context, "
        "allocator fragmentation or NCCL buffers, hence the 10% headroom; dropless expert parallel at balanced routing; comm is each collective's buffer per step, its "
        "time at NVLink 450 GB/s inside a node and 50 GB/s InfiniBand across). Generated by `tools/plan_table.py` "
        f"at commit `{commit}` in {seconds:.0f} s on one CPU thread per config.")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--readme", type=Path, help="rewrite the table between this file's markers")
    parser.add_argument("--only", nargs="*", help="plan these configs only (printing, not the README)")
    args = parser.parse_args(argv)
    dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    if args.readme and dirty:
        # Nobody types these numbers, and none comes from code that is not committed.
        print(f"plan_table: refusing to write {args.readme} from a dirty tree (commit first):\n{dirty}", file=sys.stderr)
        return 2
    names = args.only or list(CONFIGS)
    rows = []
    for name in names:
        report = plan(name, CONFIGS[name])
        print(f"{name} at {CONFIGS[name]} ranks: {report.get('error') or 'planned'} ({report['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
        rows.append((name, CONFIGS[name], report))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip()
    table = render(rows, commit)
    print(table)
    if args.readme and not args.only:
        write_readme(args.readme, table, START, END)
        print(f"table written to {args.readme}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
