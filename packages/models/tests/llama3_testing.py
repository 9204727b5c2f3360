"""Helpers shared by the llama3 tests."""

import torch

from plait.models.llama3 import ModelArgs, Transformer


def build_initialised(args: ModelArgs, seed: int = 0) -> Transformer:
    """The trainer's path: build on meta, materialise on CPU, init_weights."""
    with torch.device("meta"):
        model = Transformer(args)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.init_weights()
    return model
