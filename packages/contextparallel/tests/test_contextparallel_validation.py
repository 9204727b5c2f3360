"""Bad context-parallel settings fail locally (before any collective) with one line naming the fix."""

import pytest
import torch

from plait.contextparallel import ContextParallelConfig, ContextParallelSDPA, validate_context_parallel
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


class _NoCollectivesMesh:
    """A cp mesh of 2 that has no process group: reaching a collective would raise AttributeError."""

    def size(self):
        return 2


def _qkv(H=4, G=2, L=8, Lk=None):
    return torch.randn(1, H, L, 8), torch.randn(1, G, Lk or L, 8), torch.randn(1, G, Lk or L, 8)


class _Module(torch.nn.Module):
    is_causal = True


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda f: f(*_qkv(), attn_mask=torch.ones(8, 8, dtype=torch.bool), is_causal=False, enable_gqa=True),
         r"attn_mask \(a \(8, 8\) mask\) is not supported; it computes causal attention only"),
        (lambda f: f(*_qkv(), enable_gqa=True), r"is_causal=False \(bidirectional attention\) is not supported"),
        (lambda f: f(*_qkv(), is_causal=True, dropout_p=0.1, enable_gqa=True), r"dropout_p=0.1 is not supported"),
        (lambda f: f(*_qkv(), is_causal=True), r"4 query heads over 2 kv heads need enable_gqa=True"),
        (lambda f: f(*_qkv(L=7), is_causal=True, enable_gqa=True), r"7 tokens are not divisible into its 2 chunks"),
        (lambda f: f(*_qkv(L=1, Lk=9), is_causal=True, enable_gqa=True), r"query length 1 != key length 9 .* use_cache=False"),
        (lambda f: f.transformers_attention(_Module(), *_qkv(), torch.zeros(1, 1, 8, 8)),
         r"attention_mask \(a \(1, 1, 8, 8\) mask\) is not supported"),
        (lambda f: f.transformers_attention(_Module().train(), *_qkv(), None, dropout=0.1), r"dropout=0.1 is not supported"),
        (lambda f: f.transformers_attention(_Module(), *_qkv(), None, is_causal=False), r"module.is_causal=False"),
    ],
)
def test_sdpa_function_refuses_what_it_cannot_shard_in_one_line(call, match):
    cp_sdpa = ContextParallelSDPA(_NoCollectivesMesh(), ContextParallelConfig("ring"))
    with pytest.raises(ValueError, match=match) as err:
        call(cp_sdpa)
    assert "\n" not in str(err.value)
    ulysses = ContextParallelSDPA(_NoCollectivesMesh(), ContextParallelConfig("ulysses"))
    with pytest.raises(ValueError, match=r"method 'ulysses' splits the 3 query heads over cp = 2"):
        ulysses(*_qkv(H=3, G=1), is_causal=True, enable_gqa=True)
