import fnmatch
import inspect
import json

import torch

from plait.models.common import ScaledDotProductAttention
from plait.models.llama3 import FLAVORS, Transformer
from plait.models.llama3.model import TransformerBlock

PLAN_STRINGS = {"colwise", "rowwise", "sequence_parallel", "embedding_rowwise", "output_colwise", "prepare_input"}


def matches(pattern: str, path: str) -> bool:
    """The contract's matching: "*" stands for exactly one path component."""
    pattern_parts, path_parts = pattern.split("."), path.split(".")
    return len(pattern_parts) == len(path_parts) and all(
        fnmatch.fnmatchcase(part, pattern_part) for part, pattern_part in zip(path_parts, pattern_parts)
    )


def meta_model(name="debugmodel"):
    with torch.device("meta"):
        return Transformer(FLAVORS[name])


def test_is_plain_data():
    info = meta_model().parallel_info()
    assert json.loads(json.dumps(info)) == info
    assert set(info) == {"blocks", "tp_plan", "experts", "attention_modules", "attention_heads", "edge_units", "tp_divisible"}
    assert info["tp_divisible"] == {"n_heads": 16, "n_kv_heads": 16, "ffn_hidden": 768, "vocab_size": 2048}


def test_blocks_are_the_layers_in_forward_order():
    model = meta_model()
    modules = dict(model.named_modules())
    blocks = model.parallel_info()["blocks"]
    assert blocks == [f"layers.{i}" for i in range(6)]
    assert all(isinstance(modules[b], TransformerBlock) for b in blocks)


def test_every_tp_plan_pattern_matches_a_module():
    model = meta_model()
    paths = [name for name, _ in model.named_modules()]
    for pattern, plan in model.parallel_info()["tp_plan"].items():
        assert plan in PLAN_STRINGS, plan
        assert any(matches(pattern, path) for path in paths), pattern


def test_tp_plan_covers_every_linear_and_norm_in_a_block():
    model = meta_model()
    plan = model.parallel_info()["tp_plan"]
    for path, module in model.named_modules():
        if isinstance(module, (torch.nn.Linear, torch.nn.RMSNorm, torch.nn.Embedding)):
            assert any(matches(pattern, path) for pattern in plan), path


def test_attention_modules_and_inputs():
    model = meta_model()
    info = model.parallel_info()
    modules = dict(model.named_modules())
    assert len(info["attention_modules"]) == 6
    assert all(isinstance(modules[m], ScaledDotProductAttention) for m in info["attention_modules"])
    # The inputs context parallel shards and the trainer passes by name (docs/contracts.md).
    assert ["tokens", "positions", "document_positions"] == list(inspect.signature(model.forward).parameters)
    assert info["experts"] == []
