"""Trainer.step_sentinel: the step sentinel entered around each train_step, its per-step counts in
the metrics rows. Dense Llama has no host sync; dropless expert parallel has exactly its one
counted sync per MoE layer and micro-batch."""

from pathlib import Path

from plait.mesh.sentinel import StepSentinel
from plait.mesh.testing import run_on_ranks
from plait.trainer import testing
from plait.trainer.testing import parity_args, train_in_process

LLAMA = ["--config", "llama3_debugmodel", "--model.n_layers", "2", "--training.local_batch_size", "2"]
# 3 layers: 1 dense, 2 MoE (deepseek_v3 debugmodel's n_dense_layers = 1).
DSV3 = ["--config", "deepseek_v3_debugmodel", "--model.n_layers", "3", "--training.local_batch_size", "2"]


def test_dense_llama_step_has_no_host_sync_and_rows_carry_the_counts(tmp_path):
    s = StepSentinel(device="cpu")
    rows = train_in_process(tmp_path, *parity_args(steps=2), *LLAMA, sentinel=s)
    assert s.step_counts() == [(0, 0), (0, 0)], s.report()
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(0, 0), (0, 0)]


def _ep_rank(rank, world_size, dump):
    s = StepSentinel(device="cpu")
    rows = train_in_process(
        Path(dump), *parity_args(steps=2), *DSV3, "--parallelism.ep", "2",
        "--training.gradient_accumulation_steps", "2", sentinel=s,
    )  # fmt: skip
    return s.step_counts(), sorted({r.where for r in s.host_syncs}), rows


def test_dropless_ep_syncs_exactly_once_per_moe_layer_and_micro_batch(tmp_path):
    moe_layers, micro_batches = 2, 2
    results = run_on_ranks(_ep_rank, 2, str(tmp_path), timeout=300)
    for counts, wheres, _ in results:
        assert counts == [(moe_layers * micro_batches, 0)] * 2
        assert len(wheres) == 1 and wheres[0].startswith("plait/expertparallel/dispatch.py:")
    rows = results[0][2]
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(4, 0), (4, 0)]
    assert [r["moe_host_syncs"] for r in rows] == [4, 4]  # the dispatcher's own count agrees


def test_train_with_sentinel_returns_every_ranks_counts(tmp_path):
    rows, counts, reports = testing.train_with_sentinel(tmp_path, 2, *parity_args(steps=2), *LLAMA)
    assert counts == [[(0, 0), (0, 0)]] * 2, reports
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(0, 0), (0, 0)]
