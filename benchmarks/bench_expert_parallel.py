"""Expert parallel on CPU: plait-train vs torchtitan 0.3.0, EP overhead, host syncs, capacity mode.

    python benchmarks/bench_expert_parallel.py [--steps 10] [--warmup 2] [--repeats 2]
        [--only plait|torchtitan] [--runs NAME,...] [TOKENIZER_DIR]

Every run trains the DeepSeek-V3 debug model (6 layers, 1 dense + 5 MoE, dim 256, 16 heads, MLA
with kv_lora_rank 512, 8 routed experts top-3 + 2 shared, vocab 2048) with seq_len 256, local
batch 4 per rank, bf16 compute with fp32 master weights, no activation checkpointing, no
compile, causal SDPA attention, AdamW, on the text of plait's built-in corpus. The runs:

  plait-1          plait, 1 rank
  torchtitan-1     torchtitan, 1 rank
  plait-fsdp2      plait, 2 ranks FSDP 2, no expert parallel (every rank holds all experts)
  plait-ep2        plait, 2 ranks FSDP 2 x EP 2, dropless all-to-all dispatch
  torchtitan-ep2   torchtitan, 2 ranks FSDP 2 x EP 2 (its all-to-all token dispatcher)
  plait-ep2-cap1.25, plait-ep2-cap8
                   plait FSDP 2 x EP 2 in capacity mode (expert_capacity_factor 1.25 / 8)
  torchtitan-1-passive (only with --runs)
                   torchtitan, 1 rank, OMP_WAIT_POLICY=PASSIVE (plait-train's default; torchrun's
                   1 thread per rank makes it moot at 2 ranks)

Rounds alternate the order of the runs (a shared machine's drifting load hits all alike); the
first `--warmup` steps of every run are excluded; the script prints each run's median global
tokens/s over all kept steps of all rounds and ratios of medians measured in this invocation
(with the range of the per-round ratios). 2-rank runs use 1 thread per rank (torchrun's and
plait's default from the 2 cores), 1-rank runs 2 threads.

* plait runs through `plait-train` (`--nproc-per-node 2` for 2 ranks); tokens/s (global), and for
  EP runs `moe_host_syncs` and `moe_dropped` per step, are read from `<dump>/metrics.jsonl`.
* torchtitan runs `torchtitan_cpu.py` (patches torchtitan only; see its docstring) from the venv
  of common.py (`benchmarks/.venv`, torch pinned), under torchrun for 2
  ranks (gloo). Its `tps` is tokens/s per data-parallel rank: global = tps x dp degree. Both
  frameworks use the same backend path at 1 and 2 ranks (torchtitan:
  `--parallelism.spmd_backend partial_dtensor`, the FSDP + EP path that runs on gloo; its default
  `spmd_types` refuses FSDP 2 x EP 2 here). With `PLAIT_BENCH_COUNT_TT_SYNCS=1` (set by this
  script) torchtitan_cpu.py counts calls of torchtitan's `_sync_token_count_exchange`, the
  dispatcher's device-to-host transfer of the split sizes, and prints the count at exit.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    ANSI,
    CORPUS_DIR,
    HERE,
    REPO,
    TT_STEP,
    after_warmup,
    ensure_torchtitan_venv,
    plait_records,
)

_TT_SYNCS = re.compile(r"\[tt-syncs\] dispatcher host transfers: (\d+) calls")

# name -> (framework, ranks, ep, capacity factor)
RUNS = {
    "plait-ep2": ("plait", 2, 2, 0.0),
    "torchtitan-ep2": ("torchtitan", 2, 2, 0.0),
    "plait-fsdp2": ("plait", 2, 1, 0.0),
    "plait-ep2-cap1.25": ("plait", 2, 2, 1.25),
    "plait-ep2-cap8": ("plait", 2, 2, 8.0),
    "plait-1": ("plait", 1, 1, 0.0),
    "torchtitan-1": ("torchtitan", 1, 1, 0.0),
    # Not in the default set: torchtitan 1 rank with idle OpenMP threads sleeping instead of
    # spinning (OMP_WAIT_POLICY=PASSIVE, which plait-train sets by default before torch loads).
    "torchtitan-1-passive": ("torchtitan", 1, 1, 0.0),
}
DEFAULT_RUNS = [name for name in RUNS if name != "torchtitan-1-passive"]


def run_plait(args, workdir: Path, name: str) -> tuple[list[tuple[int, float]], list[dict]]:
    _, ranks, ep, capacity = RUNS[name]
    train_args = ["--nproc-per-node", str(ranks)] if ranks > 1 else []
    train_args += [
        "--config", "deepseek_v3_debugmodel.toml",
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--training.dtype", "bfloat16",
        "--training.steps", str(args.steps),
        "--training.activation_checkpoint", "none",
        "--training.compile", "false",
        "--metrics.log_freq", "1",
        "--metrics.tensorboard", "false",
    ]
    if ep > 1:
        train_args += ["--parallelism.ep", str(ep)]
    if capacity:
        train_args += ["--parallelism.expert_capacity_factor", str(capacity)]
    records = plait_records(train_args, workdir, name)
    return [(int(r["step"]), float(r["tokens_per_second"])) for r in records], records


def run_torchtitan(args, python: Path, workdir: Path, name: str) -> tuple[list[tuple[int, float]], int | None]:
    _, ranks, ep, _ = RUNS[name]
    dump = workdir / name
    script = [str(HERE / "torchtitan_cpu.py")]
    if ranks > 1:
        launcher = [str(python), "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(ranks)]
        env_ranks = {}
    else:
        launcher = [str(python)]
        env_ranks = dict(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    cmd = launcher + script + [
        "--module", "deepseek_v3", "--config", "deepseek_v3_debugmodel",
        "--hf_assets_path", str(args.tokenizer),
        "--dataloader.dataset_path", str(CORPUS_DIR),
        "--dump_folder", str(dump),
        "--training.seq_len", str(args.seq_len),
        "--training.local_batch_size", str(args.batch),
        "--training.steps", str(args.steps),
        "--training.mixed_precision_param", "bfloat16",
        "--training.disable_cuda_graphs",
        "--metrics.log_freq", "1",
        "--parallelism.spmd_backend", "partial_dtensor",
        "--parallelism.data_parallel_shard_degree", str(ranks),
        "--parallelism.expert_parallel_degree", str(ep),
        "activation_checkpoint:none",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", PLAIT_BENCH_COUNT_TT_SYNCS="1", **env_ranks)
    if name.endswith("-passive"):
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    log = workdir / f"{name}.log"
    print(f"[bench] {name}: {' '.join(cmd)}", flush=True)
    with open(log, "w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir)
    text = ANSI.sub("", log.read_text())
    if proc.returncode != 0:
        sys.exit(f"[bench] {name} failed (exit {proc.returncode}); last lines of {log}:\n"
                 + "\n".join(text.splitlines()[-25:]))
    # Every rank logs the same step lines; keep the first per step. tps is per data-parallel
    # rank (torchtitan divides by the non-data-parallel size, 1 here): global = tps x ranks.
    per_step: dict[int, float] = {}
    for m in TT_STEP.finditer(text):
        per_step.setdefault(int(m.group(1)), float(m.group(2).replace(",", "")) * ranks)
    syncs = [int(m.group(1)) for m in _TT_SYNCS.finditer(text)]
    return sorted(per_step.items()), (max(syncs) if syncs else None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", nargs="?", type=Path,
                        default=(REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer").resolve(),
                        help="torchtitan's test tokenizer folder (tokenizer.json)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4, help="local batch per rank")
    parser.add_argument("--repeats", type=int, default=2, help="rounds, alternating the run order")
    parser.add_argument("--only", choices=["plait", "torchtitan"], help="run one framework only")
    parser.add_argument("--runs", help=f"comma-separated subset of {','.join(RUNS)}")
    parser.add_argument("--venv", type=Path, default=HERE / ".venv", help="torchtitan's venv")
    parser.add_argument("--port", type=int, default=29561, help="torchtitan's MASTER_PORT")
    args = parser.parse_args()
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    names = args.runs.split(",") if args.runs else DEFAULT_RUNS
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        parser.error(f"unknown runs {unknown}; choose from {list(RUNS)}")
    names = [n for n in names if args.only in (None, RUNS[n][0])]
    needs_tt = any(RUNS[n][0] == "torchtitan" for n in names)
    if needs_tt and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"no tokenizer.json in {args.tokenizer}")

    import torch

    print(f"[bench] {time.strftime('%Y-%m-%d %H:%M:%S')} torch {torch.__version__}, {os.cpu_count()} CPUs; "
          f"DeepSeek-V3 debugmodel, seq {args.seq_len}, local batch {args.batch}, bf16, "
          f"{args.steps} steps ({args.warmup} warmup) x {args.repeats} rounds; "
          f"load average {os.getloadavg()}", flush=True)
    python = ensure_torchtitan_venv(args.venv) if needs_tt else None
    kept: dict[str, list[float]] = {}
    per_round: dict[str, list[float]] = {}
    syncs: dict[str, list[int]] = {}
    dropped: dict[str, list[float]] = {}
    tt_syncs: dict[str, int | None] = {}
    loads = []
    for repeat in range(1, args.repeats + 1):
        order = names if repeat % 2 else names[::-1]
        loads.append(os.getloadavg()[0])
        print(f"[bench] round {repeat}/{args.repeats}, load average {os.getloadavg()}", flush=True)
        with tempfile.TemporaryDirectory(prefix="plait-bench-ep-") as tmp:
            workdir = Path(tmp)
            for name in order:
                if RUNS[name][0] == "plait":
                    steps, records = run_plait(args, workdir, name)
                    for r in records:
                        if "moe_host_syncs" in r:
                            syncs.setdefault(name, []).append(int(r["moe_host_syncs"]))
                    if any("moe_dropped" in r for r in records):
                        dropped.setdefault(name, []).append([int(r.get("moe_dropped", 0)) for r in records])
                else:
                    steps, count = run_torchtitan(args, python, workdir, name)
                    tt_syncs[name] = count
                values = after_warmup(name, steps, args.warmup)
                kept.setdefault(name, []).extend(values)
                per_round.setdefault(name, []).append(statistics.median(values))
    loads.append(os.getloadavg()[0])
    results = {name: statistics.median(kept[name]) for name in names}
    print(f"\n[bench] load average (1 min) at the start of each round and at the end: {loads}")
    print(f"{'run':<20}{'median tok/s':>13}{'best':>8}{'steps':>7}   per-round medians")
    for name in names:
        rounds = ", ".join(f"{r:.0f}" for r in per_round[name])
        print(f"{name:<20}{results[name]:>13.0f}{max(kept[name]):>8.0f}{len(kept[name]):>7}   {rounds}")
    pairs = [("plait-1", "torchtitan-1", "plait / torchtitan, 1 rank"),
             ("plait-1", "torchtitan-1-passive", "plait / torchtitan with OMP_WAIT_POLICY=PASSIVE, 1 rank"),
             ("torchtitan-1-passive", "torchtitan-1", "torchtitan 1 rank, OMP passive / default"),
             ("plait-ep2", "torchtitan-ep2", "plait / torchtitan, FSDP 2 x EP 2"),
             ("plait-ep2", "plait-fsdp2", "plait EP 2 / EP 1 (both FSDP 2)"),
             ("plait-ep2", "plait-1", "plait FSDP 2 x EP 2 / 1 rank"),
             ("torchtitan-ep2", "torchtitan-1", "torchtitan FSDP 2 x EP 2 / 1 rank"),
             ("plait-ep2-cap1.25", "plait-ep2", "plait capacity 1.25 / dropless (EP 2)"),
             ("plait-ep2-cap8", "plait-ep2", "plait capacity 8 / dropless (EP 2)")]
    for a, b, what in pairs:
        if a in results and b in results:
            ratios = [x / y for x, y in zip(per_round[a], per_round[b])]
            print(f"ratio {a} / {b} ({what}): {results[a] / results[b]:.2f} "
                  f"(per-round {min(ratios):.2f}-{max(ratios):.2f})")
    print("\nhost syncs per step (MoE dispatch, device -> host):")
    for name in names:
        if name in syncs:
            extra = ""
            if name in dropped:
                extra = ("; (token, expert) pairs dropped on rank 0 per step, summed over the MoE "
                         f"layers, per round: {dropped[name]}")
            print(f"  {name}: moe_host_syncs per step {sorted(set(syncs[name]))}{extra}")
        elif name in tt_syncs and tt_syncs[name] is not None:
            print(f"  {name}: {tt_syncs[name]} calls of _sync_token_count_exchange on rank 0 over "
                  f"{args.steps} steps = {tt_syncs[name] / args.steps:g} per step (each: one blocking "
                  f"and one non-blocking device -> host copy)")


if __name__ == "__main__":
    main()
