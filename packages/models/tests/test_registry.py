import pytest
import torch

from plait.models import build_model, get_model_args, get_model_spec, list_models
from plait.models.llama3 import FLAVORS, Transformer


def test_llama3_spec():
    spec = get_model_spec("llama3")
    assert spec.model_cls is Transformer
    assert spec.flavors is FLAVORS
    for function in ("to_hf", "from_hf", "hf_config", "args_from_hf_config"):
        assert callable(getattr(spec.hf_adapter, function))


def test_build_model_on_meta_with_overrides():
    with torch.device("meta"):
        model = build_model("llama3", "8B", max_seq_len=4096)
    assert model.args.max_seq_len == 4096 and model.rope_cos.shape == (4096, 64)
    assert FLAVORS["8B"].max_seq_len == 131072  # the flavor itself is untouched
    assert get_model_args("llama3", "debugmodel").dim == 256


def test_deepseek_v3_and_qwen3_have_entries():
    # Registered lazily: listing them imports nothing.
    assert {"llama3", "deepseek_v3", "qwen3"} <= set(list_models())
    assert get_model_args("qwen3", "debugmodel_moe").is_moe and not get_model_args("qwen3", "debugmodel").is_moe


def test_unknown_names():
    with pytest.raises(KeyError, match="unknown model"):
        get_model_spec("gpt5")
    with pytest.raises(KeyError, match="no flavor"):
        get_model_args("llama3", "7B")
