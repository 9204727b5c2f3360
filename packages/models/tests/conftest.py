import pytest

from plait.models.llama3 import ModelArgs, RopeScaling


@pytest.fixture
def tiny_args() -> ModelArgs:
    # GQA (4 query heads over 2 kv heads) and Llama 3.1 RoPE scaling that actually bites: with
    # original_max_seq_len 16, all but the highest of the 8 frequencies are scaled or interpolated.
    return ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=128,
        multiple_of=32,
        rope_theta=10000.0,
        rope_scaling=RopeScaling(factor=8.0, original_max_seq_len=16),
        max_seq_len=64,
    )
