import pytest
import torch

from plait.models.llama3 import FLAVORS, Transformer

# Published sizes (Llama 3.1 / 3.2 model cards and HF configs).
EXPECTED = {
    # name: (parameters, ffn hidden dim)
    "debugmodel": (6_163_712, 768),
    "1B": (1_235_814_400, 8192),
    "3B": (3_212_749_824, 8192),
    "8B": (8_030_261_248, 14336),
    "70B": (70_553_706_496, 28672),
    "405B": (405_853_388_800, 53248),
}


def test_every_flavor_is_checked():
    assert set(FLAVORS) == set(EXPECTED)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_parameter_count_and_shapes_on_meta(name):
    args = FLAVORS[name]
    with torch.device("meta"):
        model = Transformer(args)
        logits = model(torch.zeros(1, 4, dtype=torch.long))
    n_params, ffn_hidden = EXPECTED[name]
    # parameters() yields a tied matrix once, as the published counts do.
    assert sum(p.numel() for p in model.parameters()) == n_params
    assert args.ffn_hidden_dim == ffn_hidden
    assert logits.shape == (1, 4, args.vocab_size)
    assert len(model.layers) == args.n_layers
    block = model.layers["0"]
    assert block.attention.wk.weight.shape == (args.n_kv_heads * args.head_dim, args.dim)
    assert block.feed_forward.w1.weight.shape == (ffn_hidden, args.dim)
    assert (model.output.weight is model.tok_embeddings.weight) == args.tie_embeddings


def test_8B_is_8_03B():
    with torch.device("meta"):
        model = Transformer(FLAVORS["8B"])
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248


def test_flops_per_token_8B():
    with torch.device("meta"):
        model = Transformer(FLAVORS["8B"])
    non_embedding = 8_030_261_248 - 128256 * 4096
    attention = 12 * 32 * 32 * 128 * 8192
    assert model.flops_per_token(8192) == 6 * non_embedding + attention == 57_914_449_920


@pytest.mark.parametrize("name", ["debugmodel", "1B"])
def test_flops_per_token_counts_parameters_except_the_embedding(name):
    args = FLAVORS[name]
    with torch.device("meta"):
        model = Transformer(args)
    # remove_duplicate=False: a tied output still costs a matmul.
    params = sum(p.numel() for n, p in model.named_parameters(remove_duplicate=False) if n != "tok_embeddings.weight")
    attention = 12 * args.n_layers * args.n_heads * args.head_dim * 256
    assert model.flops_per_token(256) == 6 * params + attention
