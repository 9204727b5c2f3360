"""The parity matrix: every supported layout up to 8 ranks, for both models, trains 10 steps with
the same global batch as one rank, and its loss at every step stays within the layout's tolerance
of the one-rank run.

One spawn per world size runs all of that size's layouts in turn (the trainer in-process, a fresh
mesh each time), so ranks start once per size instead of once per layout. Each entry's largest loss
difference is written to $PLAIT_PARITY_REPORT (the combos session sets it); tools/parity_table.py
turns that report into the README's table.
"""

import datetime
import gc
import json
import os
import re
import subprocess
from dataclasses import dataclass, field, fields
from pathlib import Path

import pytest
import torch

from plait.mesh import ParallelDims
from plait.mesh.testing import run_on_ranks
from plait.trainer.testing import parity_args

STEPS = 10
GLOBAL_BATCH = 8
MODELS = ("llama3", "deepseek_v3")
# The debug flavors at reduced depth (and, for DeepSeek-V3, smaller MLA heads) so that ~50 runs
# fit the suite's time: every block kind is still there (DeepSeek-V3: one dense block, then MoE).
MODEL_ARGS = {
    "llama3": ["--model.n_layers", "2"],
    "deepseek_v3": ["--model.n_layers", "3", "--model.n_heads", "8", "--model.kv_lora_rank", "128",
                    "--model.qk_nope_head_dim", "32", "--model.qk_rope_head_dim", "32", "--model.v_head_dim", "32"],
}  # fmt: skip
MOE_LAYERS = 2
# fp32 and deterministic kernels: what differs between layouts is the order of sums (sharded
# reductions, blockwise attention), ~1e-7 per step, grown by 10 optimizer steps. (At lr 3e-3 the
# MoE model trains chaotically: the 1-rank run itself amplifies a 1e-7 change to 1e-1 in 10 steps
# through flipped top-k choices, so no layout could be compared; at 1e-3 it trains smoothly.)
TOLERANCE = 1e-5
COMMON = [*parity_args(steps=STEPS, lr=1e-3), "--metrics.tensorboard", "false"]


@dataclass(frozen=True)
class Layout:
    name: str  # the table's row
    ranks: int
    parallelism: dict = field(default_factory=dict)
    training: dict = field(default_factory=dict)
    models: tuple[str, ...] = MODELS  # expert parallel: the MoE model only
    model_args: dict = field(default_factory=dict)
    tolerance: float = TOLERANCE

    def argv(self, model: str) -> list[str]:
        degrees = {k: v for k, v in self.parallelism.items() if k in {f.name for f in fields(ParallelDims)}}
        dp = ParallelDims(world_size=self.ranks, **degrees).dp
        local_batch = GLOBAL_BATCH // (dp * self.training.get("gradient_accumulation_steps", 1))
        args = [*COMMON, "--model.name", model, "--model.flavor", "debugmodel", *MODEL_ARGS[model],
                "--training.local_batch_size", str(local_batch)]  # fmt: skip
        for section, values in (("parallelism", self.parallelism), ("training", self.training),
                                ("model", self.model_args)):
            for key, value in values.items():
                args += [f"--{section}.{key}", str(value).lower() if isinstance(value, bool) else str(value)]
        return args


DEEPSEEK = ("deepseek_v3",)
CP1 = {"dp_shard": 1}
# fmt: off
LAYOUTS = [
    # 2 ranks
    Layout("FSDP 2", 2),
    Layout("replicate 2 (FSDP-based)", 2, {"dp_replicate": 2, "dp_shard": 1}),
    Layout("DDP 2", 2, {"dp_replicate": 2, "dp_shard": 1, "replicate_impl": "ddp"}),
    Layout("TP 2", 2, {"tp": 2, "sequence_parallel": False, "loss_parallel": False}),
    Layout("TP 2 + SP + loss parallel", 2, {"tp": 2}),
    # The sequence-wise balance loss's gradient must arrive once, not once per TP rank.
    Layout("TP 2 + SP, sequence-wise aux loss", 2, {"tp": 2}, models=DEEPSEEK, model_args={"aux_loss_coeff": 0.01}),
    Layout("CP 2 all-gather", 2, {"cp": 2, **CP1, "cp_method": "allgather"}),
    Layout("CP 2 ring", 2, {"cp": 2, **CP1, "cp_method": "ring"}),
    Layout("CP 2 ring, no load balancing", 2, {"cp": 2, **CP1, "cp_method": "ring", "cp_load_balance": False}),
    Layout("CP 2 Ulysses (all-to-all heads)", 2, {"cp": 2, **CP1, "cp_method": "ulysses"}),
    Layout("FSDP 2, full AC, accumulation 2", 2, {},
           {"activation_checkpoint": "full", "gradient_accumulation_steps": 2}),
    Layout("EP 2 dropless", 2, {"ep": 2}, models=DEEPSEEK),
    Layout("EP 2 capacity (factor 8: no drops)", 2, {"ep": 2, "expert_capacity_factor": 8}, models=DEEPSEEK),
    Layout("EP 2, full AC, accumulation 2", 2, {"ep": 2},
           {"activation_checkpoint": "full", "gradient_accumulation_steps": 2}, models=DEEPSEEK),
    Layout("CP 2 ring x EP 2", 2, {"cp": 2, **CP1, "ep": 2, "cp_method": "ring"}, models=DEEPSEEK),
    Layout("TP 2 x EP 2 (etp 1) capacity, no SP", 2,
           {"tp": 2, "ep": 2, "sequence_parallel": False, "expert_capacity_factor": 8}, models=DEEPSEEK),
    # 4 ranks
    Layout("FSDP 4", 4),
    Layout("HSDP 2x2", 4, {"dp_replicate": 2}),
    Layout("FSDP 2 x TP 2", 4, {"tp": 2}),
    Layout("FSDP 2 x CP 2 ring", 4, {"cp": 2, "cp_method": "ring"}),
    Layout("TP 2 x CP 2 all-gather", 4, {"tp": 2, "cp": 2, **CP1}),
    Layout("EP 4", 4, {"ep": 4}, models=DEEPSEEK),
    Layout("FSDP 4 x EP 2 (expert FSDP 2)", 4, {"ep": 2}, models=DEEPSEEK),
    Layout("HSDP 2x2 x EP 2", 4, {"dp_replicate": 2, "ep": 2}, models=DEEPSEEK),
    Layout("FSDP 2 x TP 2 x EP 2 (etp 1)", 4, {"tp": 2, "ep": 2}, models=DEEPSEEK),
    Layout("FSDP 2 x TP 2 x EP 2 x ETP 2", 4, {"tp": 2, "ep": 2, "etp": 2}, models=DEEPSEEK),
    # 8 ranks
    Layout("FSDP 8", 8),
    Layout("HSDP 2x4", 8, {"dp_replicate": 2}),
    Layout("HSDP 2x2 x TP 2", 8, {"dp_replicate": 2, "tp": 2}),
    Layout("HSDP 2x2 x CP 2 ring", 8, {"dp_replicate": 2, "cp": 2, "cp_method": "ring"}),
    Layout("FSDP 2 x CP 2 x TP 2", 8, {"cp": 2, "tp": 2}),
    Layout("HSDP 2x2 x TP 2 x EP 2", 8, {"dp_replicate": 2, "tp": 2, "ep": 2}, models=DEEPSEEK),
    Layout("FSDP 2 x CP 2 x TP 2 x EP 4", 8, {"cp": 2, "tp": 2, "ep": 4}, models=DEEPSEEK),
]
# fmt: on
ENTRIES = [(layout, model) for layout in LAYOUTS for model in layout.models]


def _key(layout: Layout, model: str) -> str:
    return f"{model}: {layout.name}"


def _test_id(layout: Layout, model: str) -> str:
    """e.g. deepseek_v3-2-fsdp_2_x_tp_2: selectable with -k."""
    return f"{model}-{layout.ranks}-" + re.sub(r"[^a-z0-9]+", "_", layout.name.lower()).strip("_")


def _reference_key(layout: Layout, model: str) -> tuple:
    """The one-rank run a layout is compared with: same model, same model arguments."""
    return model, tuple(sorted(layout.model_args.items()))


def _train_each(rank: int, world_size: int, root: str, jobs: list[tuple[str, str, list[str]]]) -> dict:
    """On every rank: train each job in turn in this process; rank 0 returns each job's metrics rows."""
    from plait.trainer.cli import parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.testing import read_metrics
    from plait.trainer.train import Trainer

    rows = {}
    for key, model, argv in jobs:
        dump = os.path.join(root, str(len(rows)))
        args = parse_args(["--job.dump_folder", dump, *argv])
        trainer = Trainer(build_config(load_toml(f"{model}_debugmodel.toml"), args.overrides))
        try:
            trainer.train()
        finally:
            trainer.release(0)
        del trainer
        gc.collect()
        rows[key] = read_metrics(dump) if rank == 0 else None
    return rows


def _run_world(ranks: int, root: Path) -> dict:
    jobs = [(_key(layout, model), model, layout.argv(model)) for layout, model in ENTRIES if layout.ranks == ranks]
    if ranks == 1:  # the references: one rank, the whole global batch, each model setting once
        keys = dict.fromkeys(_reference_key(layout, model) for layout, model in ENTRIES)
        jobs = [(key, key[0], Layout("one rank", 1, model_args=dict(key[1])).argv(key[0])) for key in keys]
    # ~10 s per job at 8 ranks on 2 cores; bounded so a hang fails.
    return run_on_ranks(_train_each, ranks, str(root), jobs, timeout=120 + 40 * len(jobs) * ranks)[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Metrics rows by entry key, each world size run on first use."""
    done: dict[int, dict] = {}

    def get(ranks: int) -> dict:
        if ranks not in done:
            done[ranks] = _run_world(ranks, tmp_path_factory.mktemp(f"world{ranks}"))
        return done[ranks]

    return get


@pytest.fixture(scope="module")
def report():
    """The entries measured in this module, written as JSON to $PLAIT_PARITY_REPORT at the end."""
    entries: list[dict] = []
    yield entries
    path = os.environ.get("PLAIT_PARITY_REPORT")
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(_report(entries), indent=1) + "\n")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=Path(__file__).parent)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def _report(entries: list[dict]) -> dict:
    return {
        "date": datetime.date.today().isoformat(),
        "commit": _git("rev-parse", "--short=12", "HEAD") or "unknown",
        "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        "torch": torch.__version__,
        "steps": STEPS,
        "global_batch": GLOBAL_BATCH,
        "expected": len(ENTRIES),
        "entries": entries,
    }


@pytest.mark.parametrize("layout, model", ENTRIES, ids=[_test_id(lay, m) for lay, m in ENTRIES])
def test_layout_matches_one_rank_for_ten_steps(layout, model, runs, report):
    reference = runs(1)[_reference_key(layout, model)]
    rows = runs(layout.ranks)[_key(layout, model)]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    loss_diff = max(abs(r["loss"] - ref["loss"]) for r, ref in zip(rows, reference))
    # The global gradient norm (clipping uses it) catches what the loss hides for a few steps:
    # doubled expert gradients, an axis counted twice.
    norm_rel = max(abs(r["grad_norm"] - ref["grad_norm"]) / ref["grad_norm"] for r, ref in zip(rows, reference))
    report.append({
        "layout": layout.name, "model": model, "ranks": layout.ranks, "tolerance": layout.tolerance,
        "max_loss_diff": loss_diff, "max_grad_norm_rel_diff": norm_rel,
        "passed": loss_diff <= layout.tolerance and norm_rel <= 1e-4,
    })  # fmt: skip
    assert loss_diff <= layout.tolerance, [(r["loss"], ref["loss"]) for r, ref in zip(rows, reference)]
    assert norm_rel <= 1e-4, [(r["grad_norm"], ref["grad_norm"]) for r, ref in zip(rows, reference)]
    if model == "deepseek_v3":
        # Per MoE layer max/mean tokens per expert, from counts summed over the dp x cp ranks.
        assert all(len(r["moe_imbalance"]) == MOE_LAYERS and min(r["moe_imbalance"]) >= 1.0 for r in rows)
        ep = layout.parallelism.get("ep", 1)
        if ep > 1 and layout.training.get("activation_checkpoint", "none") == "none":
            # Dropless: one host sync per MoE layer and micro-batch; capacity mode: none.
            expected = 0 if layout.parallelism.get("expert_capacity_factor") else MOE_LAYERS
            assert [r["moe_host_syncs"] for r in rows] == [expected] * STEPS
