"""Bad context-parallel settings fail locally (before any collective) with one line naming the fix."""

import pytest

from plait.contextparallel import ContextParallelConfig, validate_context_parallel
from plait.mesh import ParallelConfigError

INFO = {"attention_modules": ["layers.0.attention.sdpa"], "attention_heads": {"n_heads": 16, "n_kv_heads": 8}}


@pytest.mark.parametrize(
    "info, cp, seq_len, config, tp, match",
    [
        (INFO, 2, 102, ContextParallelConfig(), 1, r"training.seq_len = 102 is not divisible by 2 x parallelism.cp = 4"),
        (INFO, 4, 2048, ContextParallelConfig("zigzag"), 1, r"parallelism.cp_method = 'zigzag'"),
        (INFO, 4, 2048, ContextParallelConfig("ulysses"), 8, r"16 attention heads over tp x cp = 32"),
        ({"attention_modules": []}, 2, 64, ContextParallelConfig(), 1, r"needs the attention contract"),
        ({"attention_modules": ["a.sdpa"]}, 2, 64, ContextParallelConfig("ulysses"), 1, r"needs the model's head count"),
        (INFO, 2, 64, ContextParallelConfig("ring"), 1, r"model.attention_mask = 'sliding': .* set model.attention_mask"),
        (INFO, 2, 72, ContextParallelConfig(load_balance_rounds=4), 1,
         r"training.seq_len = 72 is not divisible by 2 x parallelism.cp x parallelism.cp_load_balance_rounds = "
         r"2 x 2 x 4 = 16 .*: use a seq_len that is a multiple of 16, or fewer cp_load_balance_rounds"),
        (INFO, 2, 64, ContextParallelConfig(load_balance_rounds=0), 1, r"parallelism.cp_load_balance_rounds = 0: .* set it to 1"),
    ],
)
def test_bad_settings_name_the_fix(info, cp, seq_len, config, tp, match):
    mask = "sliding" if "attention_mask" in match else "causal"
    with pytest.raises(ParallelConfigError, match=match) as err:
        validate_context_parallel(info, cp, seq_len, config, tp=tp, attention_mask=mask)
    assert "\n" not in str(err.value)


def test_good_settings_pass():
    for method in ("allgather", "ring", "ulysses"):
        validate_context_parallel(INFO, 4, 2048, ContextParallelConfig(method), tp=4)
        validate_context_parallel(INFO, 2, 64, ContextParallelConfig(method, load_balance=False), tp=1)
        # Document masking needs nothing more of any method.
        validate_context_parallel(INFO, 4, 2048, ContextParallelConfig(method), tp=4, attention_mask="document")
        rounds = ContextParallelConfig(method, load_balance_rounds=4)
        validate_context_parallel(INFO, 4, 2048, rounds, tp=4, attention_mask="document")  # 2048 = 64 x 32
