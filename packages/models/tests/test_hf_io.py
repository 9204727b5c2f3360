import json

import pytest
import torch

from plait.models.hf.io import INDEX_FILE, SINGLE_FILE, load_safetensors, parse_size, save_safetensors


def small_state_dict():
    torch.manual_seed(0)
    return {f"layer{i}.weight": torch.randn(16, 16) for i in range(5)} | {"bias": torch.randn(3)}


def test_sharded_round_trip_with_index(tmp_path):
    state_dict = small_state_dict()
    files = save_safetensors(state_dict, tmp_path, max_shard_size=2 * 16 * 16 * 4)
    assert [f.name for f in files] == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == sum(t.numel() * 4 for t in state_dict.values())
    assert list(index["weight_map"]) == list(state_dict)
    loaded = load_safetensors(tmp_path)
    assert loaded.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        assert torch.equal(loaded[name], tensor), name


def test_single_shard_and_dtype_cast(tmp_path):
    state_dict = small_state_dict()
    assert save_safetensors(state_dict, tmp_path, dtype=torch.bfloat16) == [tmp_path / SINGLE_FILE]
    assert not (tmp_path / INDEX_FILE).exists()
    loaded = load_safetensors(tmp_path / SINGLE_FILE)
    assert all(t.dtype == torch.bfloat16 for t in loaded.values())
    torch.testing.assert_close(loaded["bias"], state_dict["bias"].bfloat16())


def test_shared_and_view_tensors_are_saved(tmp_path):
    # Tied weights and slices of one storage: safetensors refuses shared storage, so io copies.
    weight = torch.randn(4, 4)
    save_safetensors({"a": weight, "b": weight, "row": weight[1]}, tmp_path)
    loaded = load_safetensors(tmp_path)
    assert torch.equal(loaded["b"], weight) and torch.equal(loaded["row"], weight[1])


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("500mb") == 500 * 10**6
    assert parse_size(123) == 123
    with pytest.raises(ValueError):
        parse_size("lots")
