"""plait-plan's planned peak memory and step time for each plait run of a GPU lease, to put beside
the measured ones in its table (benchmarks/lease_table.py).

    python benchmarks/lease_plan.py OUT [--deadline S] [--jobs N] [--device h100|h200] [--dry-run]

OUT is a lease's folder (gpu/lease.sh's $OUT, or benchmarks/leases/<date>-<commit>/): its
bench.jsonl holds each plait run's plait-train arguments (`plait_args`). Each distinct layout is
planned once: eager, compile and CUDA graphs trace the same eager step (plait-plan traces
`training.compile` eagerly), float8 does not. `python -m plait.plan.cli <the run's arguments>
--plan.device D --plan.json F`, on the CPU (a fake process group, fake tensors: no GPU), several
at a time (--jobs), each within what is left of --deadline. One record per plait run in
OUT/plan.jsonl (replaced):

  planned_peak_gib   the plan's traced peak, the first step's or a later one's, the larger
                     (parameters, gradients, AdamW state, activations, temporaries: tensors only,
                     like torch.cuda.max_memory_allocated over the run, the measured peak)
  planned_step_ms    the plan's ideal step: its FLOPs (the model's flops_per_token, causal
                     attention counted whole) at the device's dense bf16 peak, plus communication
                     (none on one GPU); so measured / planned is 1 / MFU
  planned_tflop      the step's FLOPs (10^12); host_kernel_ops: the eager step's kernel launches
  plan_device        h100 or h200: --device, else the GPU named in OUT/env.txt
  error              where the plan failed or was not made (its last line)

The lease runs it as its `plan` stage after bench; here, after a lease, it plans what the stage
left out (on the lease's commit). --dry-run plans the first layout only (the dry run's time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from lease_table import read_env, read_jsonl

# plait-train arguments that do not change the plan (it traces the eager step either way).
_SAME_PLAN = ("--training.compile", "--training.compile_mode", "--metrics.profile_interval")


def layout_key(plait_args: list[str]) -> tuple[str, ...]:
    """The run's arguments less those that do not change its plan (pairs `--key value`)."""
    kept, skip = [], False
    for i, arg in enumerate(plait_args):
        if skip:
            skip = False
        elif arg in _SAME_PLAN and i + 1 < len(plait_args):
            skip = True
        else:
            kept.append(arg)
    return tuple(kept)


def plan_device(out: Path, device: str | None) -> str:
    return device or ("h200" if "H200" in read_env(out).get("gpu", "") else "h100")


def plan_one(args: tuple[str, ...], device: str, timeout: float) -> dict:
    """plait-plan on one layout: its figures, or {"error": ...}."""
    if timeout <= 1:
        return {"error": "not planned: the deadline passed"}
    with tempfile.TemporaryDirectory(prefix="plait-lease-plan-") as tmp:
        path = Path(tmp) / "plan.json"
        cmd = [sys.executable, "-m", "plait.plan.cli", *args, "--plan.device", device, "--plan.json", str(path)]
        env = dict(os.environ, OMP_NUM_THREADS="2", PYTHONUNBUFFERED="1")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=tmp)
        except subprocess.TimeoutExpired:
            return {"error": f"not planned: stopped at {timeout:.0f} s"}
        if proc.returncode != 0 or not path.exists():
            last = next((ln for ln in reversed((proc.stdout + proc.stderr).splitlines()) if ln.strip()), "")
            return {"error": f"plait-plan exit {proc.returncode}: {last}"[:200]}
        plan = json.loads(path.read_text())
    memory = plan["memory"]  # max_memory_allocated never resets: the first step's peak counts too
    return {
        "planned_peak_gib": max(memory["peak"], memory.get("first_step_peak") or 0) / 2**30,
        "planned_step_ms": plan["ideal_step_seconds"] * 1e3,
        "planned_tflop": plan["flops_per_rank"] / 1e12,
        "host_kernel_ops": plan.get("host_kernel_ops_per_step"),
        "plan_fits": plan.get("fits"),
    }


def plan_lease(out: Path, deadline: float, jobs: int, device: str | None, dry_run: bool) -> list[dict]:
    """Plan every distinct layout of OUT's plait runs; one record per run (most wanted first: the
    runs' order in bench.jsonl)."""
    runs = [r for r in read_jsonl(out / "bench.jsonl") if r.get("plait_args") and "error" not in r]
    layouts = list(dict.fromkeys(layout_key(r["plait_args"]) for r in runs))
    device, start = plan_device(out, device), time.monotonic()
    chosen = layouts[:1] if dry_run else layouts

    def one(layout: tuple[str, ...]) -> dict:
        if layout not in chosen:
            return {"error": "dry run: only the first layout planned"}
        return plan_one(layout, device, deadline - (time.monotonic() - start))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        plans = dict(zip(layouts, pool.map(one, layouts)))
    return [{"config": r["config"], "mask": r["mask"], "mode": r["mode"], "plan_device": device,
             **plans[layout_key(r["plait_args"])]} for r in runs]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the lease's folder (its bench.jsonl)")
    parser.add_argument("--deadline", type=float, default=600, help="seconds for all the plans")
    parser.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1), help="plans at a time")
    parser.add_argument("--device", choices=("h100", "h200"), help="default: the GPU named in OUT/env.txt")
    parser.add_argument("--dry-run", action="store_true", help="plan the first layout only")
    args = parser.parse_args(argv)
    records = plan_lease(args.out, args.deadline, args.jobs, args.device, args.dry_run)
    with open(args.out / "plan.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for r in records:
        figures = r.get("error") or f"peak {r['planned_peak_gib']:.1f} GiB, ideal step {r['planned_step_ms']:.0f} ms"
        print(f"[plan] {r['config']} {r['mask']} {r['mode']} ({r['plan_device']}): {figures}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
