"""Host work per step: the ops one eager training step dispatches (each at least one kernel launch
on a GPU), plait and torchtitan 0.3.0 side by side, and plait's document-masked step against its
causal one.

    python benchmarks/bench_host_ops.py [--results benchmarks/RESULTS.md] [--skip-torchtitan]
        [--torchtitan-python PATH] [TOKENIZER_DIR]

What is counted: `Trainer.train_step` of each framework (forward, loss, backward, gradient
clipping, optimizer step, learning-rate schedule; plait's MoE load-balance update, torchtitan's
token count), rank 0, with plait's HostOpCounter (packages/trainer/.../plan/host_ops.py: a
TorchDispatchMode, one count per op as it reaches the dispatcher below autograd, DTensor desugared
to its local ops, a custom op once). Step 2 of a run is the one counted: the first step also makes
the optimizer's state. The batch is drawn before the counted step (plait's step is handed it;
torchtitan's data iterator is drained first), and neither framework logs in it (torchtitan's
`log_freq` 10). "ops" is every op, "kernel ops" leaves out views, `empty`-like allocations and
profiler ranges (`NO_KERNEL` there): no GPU kernel. Real tensors on CPU, gloo; bf16 compute with
fp32 master weights on both sides, as in `benchmarks/suite.py`; torchtitan through
`torchtitan_cpu.py` (causal SDPA in place of FlexAttention).

Configs (the suite's models, smaller batches: an op count does not depend on the batch):
  llama3-1        Llama 3 debug, seq 256, batch 2, 1 rank
  llama3-fsdp2    the same on 2 ranks, FSDP 2
  deepseek-1      DeepSeek-V3 debug, seq 256, batch 2, 1 rank
  deepseek-ep2    DeepSeek-V3 debug, 2 ranks FSDP 2 x EP 2 (all-to-all dispatch)
plait only:
  deepseek-1, skewed routing: every token the same, so every token picks the same experts and the
      others receive none: the MoE's ops must not depend on how many tokens each expert gets;
  Llama 3 debug at seq 2048, batch 1: causal, then document-masked with 1, 4 and 16 documents per
      row (a document mask is one attention op per layer, however many documents).

Two ranks run on gloo, which has no reduce-scatter: plait's FSDP then reduce-scatters with an
all-to-all plus a sum (plait.dataparallel.cpu_overlap; on NCCL one reduce-scatter op), torchtitan with
gloo's own. The whole run takes a couple of minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import CORPUS_DIR, REPO, TORCHTITAN_VERSION, ensure_torchtitan_venv, torch_version  # noqa: E402

COUNTED_STEP = 2


@dataclass(frozen=True)
class Case:
    model: str  # llama3 | deepseek_v3
    seq: int
    batch: int
    ranks: int = 1
    ep: int = 1
    torchtitan: bool = True
    documents: int = 0  # documents per row under a document mask; 0: causal
    skewed: bool = False  # every token the same (routing all to the same experts)
    extra: tuple = field(default_factory=tuple)


CASES = {
    "llama3-1": Case("llama3", 256, 2),
    "llama3-fsdp2": Case("llama3", 256, 2, ranks=2),
    "deepseek-1": Case("deepseek_v3", 256, 2),
    "deepseek-ep2": Case("deepseek_v3", 256, 2, ranks=2, ep=2),
}
MOE_SKEWED = Case("deepseek_v3", 256, 2, torchtitan=False, skewed=True)
DOCUMENT_SEQ = 2048
DOCUMENTS = {n: Case("llama3", DOCUMENT_SEQ, 1, torchtitan=False, documents=n) for n in (0, 1, 4, 16)}


def plait_argv(case: Case, dump: str) -> list[str]:
    argv = ["--config", f"{case.model}_debugmodel.toml", "--job.dump_folder", dump,
            "--training.seq_len", str(case.seq), "--training.local_batch_size", str(case.batch),
            "--training.dtype", "bfloat16", "--training.activation_checkpoint", "none",
            "--training.compile", "false", "--metrics.tensorboard", "false", "--checkpoint.enable", "false"]  # fmt: skip
    if case.ranks > 1:
        argv += ["--parallelism.dp_shard", str(case.ranks)]
    if case.ep > 1:
        argv += ["--parallelism.ep", str(case.ep)]
    if case.documents:
        argv += ["--model.attention_mask", "document"]
    return [*argv, *case.extra]


def _plait_rank(rank: int, world_size: int, argv: list[str], documents: int, skewed: bool) -> dict:
    """Build plait's trainer as plait-train does, run step 1, count step 2 (rank 0's answer is kept)."""
    import torch

    from plait.plan.host_ops import HostOpCounter
    from plait.plan.trace import micro_batch
    from plait.trainer.cli import parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.train import Trainer

    parsed = parse_args(argv)
    config = build_config(load_toml(parsed.config), parsed.overrides)
    trainer = Trainer(config)
    generator = torch.Generator().manual_seed(rank)
    vocab = trainer.plan.model_args.vocab_size

    def batch():
        _, _, documents_BS = micro_batch(config, documents_per_row=max(documents, 1))
        shape = documents_BS.shape
        tokens_BS = torch.full(shape, 7) if skewed else torch.randint(0, vocab, shape, generator=generator)
        return tokens_BS, torch.randint(0, vocab, shape, generator=generator), documents_BS

    try:
        for step in range(1, COUNTED_STEP + 1):
            batches = [batch() for _ in range(config.training.gradient_accumulation_steps)]
            trainer._read_documents(batches)  # on the host before the step, as the training loop does
            if step < COUNTED_STEP:
                trainer.train_step(batches)
                continue
            counter = HostOpCounter()
            with counter:
                trainer.train_step(batches)
        return {"ops": counter.ops(), "kernel_ops": counter.kernel_ops(), "by_op": dict(counter.by_op())}
    finally:
        trainer.release(0)


def run_plait(case: Case, workdir: Path, name: str) -> dict:
    from plait.testing import run_on_ranks

    argv = plait_argv(case, str(workdir / name))
    return run_on_ranks(_plait_rank, case.ranks, argv, case.documents, case.skewed, timeout=900)[0]


def run_torchtitan(python: Path, case: Case, workdir: Path, name: str, tokenizer: Path, port: int) -> dict:
    """torchtitan's own entry point (torchtitan_cpu.py), counted by its PLAIT_BENCH_COUNT_OPS patch."""
    out, log = workdir / f"{name}.json", workdir / f"{name}.log"
    script = str(HERE / "torchtitan_cpu.py")
    if case.ranks > 1:
        cmd = [str(python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(case.ranks), script]
    else:
        cmd = [str(python), script]
    cmd += ["--module", case.model, "--config", f"{case.model}_debugmodel", "--hf_assets_path", str(tokenizer),
            "--dataloader.dataset_path", str(CORPUS_DIR), "--dump_folder", str(workdir / name),
            "--training.seq_len", str(case.seq), "--training.local_batch_size", str(case.batch),
            "--training.steps", str(COUNTED_STEP), "--training.mixed_precision_param", "bfloat16",
            "--metrics.log_freq", "10", "--parallelism.spmd_backend", "partial_dtensor",
            "--parallelism.data_parallel_shard_degree", str(case.ranks)]  # fmt: skip
    if case.model == "deepseek_v3":
        cmd += ["--training.disable_cuda_graphs", "--parallelism.expert_parallel_degree", str(case.ep)]
    cmd.append("activation_checkpoint:none")
    env = dict(os.environ, PYTHONUNBUFFERED="1", PLAIT_BENCH_COUNT_OPS=str(out),
               PLAIT_BENCH_COUNT_OPS_STEP=str(COUNTED_STEP))  # fmt: skip
    if case.ranks == 1:
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port))  # fmt: skip
    print(f"[bench] {name}: {' '.join(cmd)}\n[bench] log: {log}", flush=True)
    with open(log, "w") as f:
        rc = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=workdir, timeout=900)
    if rc != 0 or not out.exists():
        tail = " | ".join(log.read_text().splitlines()[-3:])[:300]
        return {"error": f"exit {rc}: {tail}"}
    return json.loads(out.read_text())


def torchtitan_python(args) -> Path | None:
    if args.skip_torchtitan:
        return None
    if args.torchtitan_python:
        return args.torchtitan_python
    probe = subprocess.run([sys.executable, "-c", "import importlib.metadata as m; print(m.version('torchtitan'))"],
                           capture_output=True, text=True)  # fmt: skip
    return Path(sys.executable) if probe.stdout.strip() == TORCHTITAN_VERSION else ensure_torchtitan_venv(args.venv)


def _n(result: dict | None, key: str) -> str:
    if result is None:
        return "-"
    return f"{result[key]:,}" if key in result else f"failed ({result['error'][:60]})"


def _ratio(a: dict | None, b: dict | None, key: str) -> str:
    if not a or not b or key not in a or key not in b:
        return "-"
    return f"{a[key] / b[key]:.2f}x"


def _top_extra(plait: dict, titan: dict, n: int = 5) -> str:
    """The kernel ops plait dispatches most more often than torchtitan (what to remove next)."""
    from importlib.util import module_from_spec, spec_from_file_location

    spec = spec_from_file_location("host_ops", REPO / "packages/plan/src/plait/plan/host_ops.py")
    host_ops = module_from_spec(spec)
    spec.loader.exec_module(host_ops)
    diff = {op: plait["by_op"].get(op, 0) - titan["by_op"].get(op, 0)
            for op in set(plait["by_op"]) | set(titan["by_op"]) if op not in host_ops.NO_KERNEL}  # fmt: skip
    top = sorted((d, op) for op, d in diff.items() if d > 0)[::-1][:n]
    return ", ".join(f"{op.removeprefix('aten::')} +{d}" for d, op in top) or "-"


def report(results: dict) -> tuple[list[str], list[str]]:
    lines = ["| config | ranks | plait ops | plait kernel ops | torchtitan ops | torchtitan kernel ops | "
             "plait / torchtitan (kernel ops) | plait's most over torchtitan (kernel ops) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for name, case in CASES.items():
        p, t = results.get(f"plait:{name}"), results.get(f"torchtitan:{name}")
        extra = _top_extra(p, t) if p and t and "by_op" in p and "by_op" in t else "-"
        lines.append(f"| {name} | {case.ranks}{f' (EP {case.ep})' if case.ep > 1 else ''} | {_n(p, 'ops')} | "
                     f"{_n(p, 'kernel_ops')} | {_n(t, 'ops')} | {_n(t, 'kernel_ops')} | "
                     f"{_ratio(p, t, 'kernel_ops')} | {extra} |")  # fmt: skip
    notes = []
    p, s = results.get("plait:deepseek-1"), results.get("plait:deepseek-1-skewed")
    if p and s and "ops" in p and "ops" in s:
        same = p["ops"] == s["ops"] and p["kernel_ops"] == s["kernel_ops"]
        notes.append(f"MoE routing: plait deepseek-1 with every token the same (all routed to the same experts) "
                     f"{s['ops']:,} ops / {s['kernel_ops']:,} kernel ops vs {p['ops']:,} / {p['kernel_ops']:,} with "
                     f"random tokens: {'the same' if same else 'DIFFERENT'}.")  # fmt: skip
    lines += ["", f"plait Llama 3 debug, seq {DOCUMENT_SEQ}, batch 1, 1 rank:", "",
              "| attention | ops | kernel ops | vs causal (ops) | vs causal (kernel ops) |", "|---|---:|---:|---:|---:|"]
    causal = results.get("plait:document-0")
    for n in DOCUMENTS:
        r = results.get(f"plait:document-{n}")
        what = "causal" if n == 0 else f"document mask, {n} per row"
        lines.append(f"| {what} | {_n(r, 'ops')} | {_n(r, 'kernel_ops')} | {_ratio(r, causal, 'ops')} | "
                     f"{_ratio(r, causal, 'kernel_ops')} |")
    return lines, notes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer", nargs="?", type=Path,
                        default=(REPO / ".." / "shared" / "bench" / "torchtitan-tokenizer").resolve(),
                        help="torchtitan's test tokenizer folder (tokenizer.json)")  # fmt: skip
    parser.add_argument("--skip-torchtitan", action="store_true")
    parser.add_argument("--torchtitan-python", type=Path, help="a python with torchtitan 0.3.0 and this torch")
    parser.add_argument("--venv", type=Path, default=HERE / ".venv", help="torchtitan's venv if not importable here")
    parser.add_argument("--port", type=int, default=29591)
    parser.add_argument("--results", metavar="PATH", help="also put the tables into this markdown file, newest first")
    args = parser.parse_args()
    python = torchtitan_python(args)
    if python is not None and not (args.tokenizer / "tokenizer.json").is_file():
        parser.error(f"no tokenizer.json in {args.tokenizer}")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    started = time.time()
    results: dict[str, dict] = {}
    runs = [(f"plait:{name}", case) for name, case in CASES.items()]
    runs += [("plait:deepseek-1-skewed", MOE_SKEWED)]
    runs += [(f"plait:document-{n}", case) for n, case in DOCUMENTS.items()]
    if python is not None:
        runs += [(f"torchtitan:{name}", case) for name, case in CASES.items() if case.torchtitan]
    with tempfile.TemporaryDirectory(prefix="plait-host-ops-") as tmp:
        workdir = Path(tmp)
        for key, case in runs:
            t0 = time.time()
            name = key.replace(":", "-")
            try:
                if key.startswith("plait:"):
                    results[key] = run_plait(case, workdir, name)
                else:
                    results[key] = run_torchtitan(python, case, workdir, name, args.tokenizer, args.port)
            except Exception as e:  # one failed config is reported in the table, the rest still run
                results[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"}
            r = results[key]
            print(f"[bench] {key}: {_n(r, 'ops')} ops, {_n(r, 'kernel_ops')} kernel ops ({time.time() - t0:.0f} s)",
                  flush=True)  # fmt: skip
    lines, notes = report(results)
    head = (f"torch {torch_version()}; torchtitan {TORCHTITAN_VERSION if python else '(skipped)'}; commit "
            f"{_commit()}; step {COUNTED_STEP} of each run counted on rank 0; bf16 compute, fp32 master weights; "
            f"{(time.time() - started) / 60:.1f} min.")
    text = "\n".join(lines) + ("\n\n" + "\n".join(f"- {n}" for n in notes) if notes else "")
    print(f"\n{head}\n\n{text}")
    (HERE / ".last_host_ops.json").write_text(json.dumps(results, indent=1))
    if args.results:
        section = (f"## Host ops per training step, plait vs torchtitan, {datetime.date.today()} "
                   f"(`benchmarks/bench_host_ops.py`, run by `nox -s bench`)\n\n{head}\n\n{text}\n")
        body = open(args.results).read()
        title, _, rest = body.partition("\n")
        with open(args.results, "w") as f:
            f.write(f"{title}\n\n{section}{rest}")
        print(f"[bench] section added to {args.results}")


def _commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, cwd=REPO)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                           text=True, cwd=REPO).stdout.strip()  # fmt: skip
    return (out.stdout.strip() or "unknown") + (" (uncommitted changes)" if dirty else "")


if __name__ == "__main__":
    main()
