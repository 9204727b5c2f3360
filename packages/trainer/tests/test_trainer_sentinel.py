"""Trainer.step_sentinel: the step sentinel entered around each train_step, its per-step counts in
the metrics rows. Dense Llama has no host sync. (Expert parallel's counted syncs, with and without
AC and accumulation, are checked on every parity-matrix entry: tests/test_combo_parity_matrix.py.)"""

from plait.testing import trainer as testing
from plait.testing.sentinel import StepSentinel
from plait.testing.trainer import parity_args, train_in_process

LLAMA = ["--config", "llama3_debugmodel", "--model.n_layers", "2", "--training.local_batch_size", "2"]


def test_dense_llama_step_has_no_host_sync_and_rows_carry_the_counts(tmp_path):
    s = StepSentinel(device="cpu")
    rows = train_in_process(tmp_path, *parity_args(steps=2), *LLAMA, sentinel=s)
    assert s.step_counts() == [(0, 0), (0, 0)], s.report()
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(0, 0), (0, 0)]


def test_train_with_sentinel_returns_every_ranks_counts(tmp_path):
    rows, counts, reports = testing.train_with_sentinel(tmp_path, 2, *parity_args(steps=2), *LLAMA)
    assert counts == [[(0, 0), (0, 0)]] * 2, reports
    assert [(r["host_syncs"], r["precondition_violations"]) for r in rows] == [(0, 0), (0, 0)]
