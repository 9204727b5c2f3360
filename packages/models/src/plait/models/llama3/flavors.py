"""Named Llama 3 sizes: the published Llama 3.1 / 3.2 hyperparameters plus a debug model.

The published models were trained to 131072 positions; `max_seq_len` only sizes the RoPE tables,
so a trainer may lower it to its training sequence length.
"""

from plait.models.llama3.args import ModelArgs, RopeScaling

LLAMA3_VOCAB_SIZE = 128256
LLAMA31_MAX_SEQ_LEN = 131072

FLAVORS: dict[str, ModelArgs] = {
    # torchtitan's debug model: vocab 2048 matches its small test tokenizer.
    "debugmodel": ModelArgs(dim=256, n_layers=6, n_heads=16, vocab_size=2048, rope_theta=500000, max_seq_len=2048),
    # Llama 3.2 (text): tied embeddings, RoPE scaled by 32.
    "1B": ModelArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=256,
        ffn_dim_multiplier=1.5,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=LLAMA31_MAX_SEQ_LEN,
        tie_embeddings=True,
    ),
    "3B": ModelArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=256,
        ffn_dim_multiplier=1.0,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=32.0),
        max_seq_len=LLAMA31_MAX_SEQ_LEN,
        tie_embeddings=True,
    ),
    # Llama 3.1.
    "8B": ModelArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=1024,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=LLAMA31_MAX_SEQ_LEN,
    ),
    "70B": ModelArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.3,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=LLAMA31_MAX_SEQ_LEN,
    ),
    "405B": ModelArgs(
        dim=16384,
        n_layers=126,
        n_heads=128,
        n_kv_heads=8,
        vocab_size=LLAMA3_VOCAB_SIZE,
        multiple_of=4096,
        ffn_dim_multiplier=1.2,
        rope_theta=500000,
        rope_scaling=RopeScaling(factor=8.0),
        max_seq_len=LLAMA31_MAX_SEQ_LEN,
    ),
}
