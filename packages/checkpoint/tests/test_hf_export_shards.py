"""The files of a sharded Hugging Face export: each writer's tensors are cut by huggingface_hub's
splitter (in order, under max_shard_size), the files of all writers numbered in one sequence, and
the index maps every tensor to its file. One process, no process group."""

import dataclasses
import json

import torch

from plait.checkpoint import hf_shards


def test_split_is_the_hubs_grouping_by_bytes_written():
    tensors = {f"w{i}": torch.zeros(n, dtype=torch.bfloat16) for i, n in enumerate([300, 300, 100, 300, 100, 100])}
    tensors["view"] = torch.zeros(1000)[:10]  # 40 bytes written, though its storage holds 4000
    files, total = hf_shards.split(tensors, 1200)
    assert files == [["w0", "w1"], ["w2", "w3", "w4", "w5"], ["view"]] and total == 2440
    assert hf_shards.split(tensors, "1KB")[0] == [["w0"], ["w1", "w2"], ["w3", "w4", "w5"], ["view"]]
    assert hf_shards.split(tensors)[0] == [list(tensors)]  # 5 GB: one file
    assert hf_shards.split({}) == ([], 0)


def test_files_are_numbered_over_all_writers():
    # (position among the writers, files): two writers of 2 and 3 files, a rank that writes none.
    everyone = [(0, 2), (1, 3), (2, 0)]
    assert [hf_shards.file_numbers(mine, everyone) for mine in everyone] == [(1, 5), (3, 5), (6, 5)]
    assert hf_shards.file_name(3, 5) == "model-00003-of-00005.safetensors"


def _model():
    from plait.models.llama3 import FLAVORS, Transformer

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=4, vocab_size=256)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    return model, args


def test_export_cuts_a_writer_into_numbered_files_transformers_layout(tmp_path):
    from plait.checkpoint.hf_sharded import export_hf_sharded, load_hf_sharded
    from plait.models.hf import llama3 as adapter
    from plait.models.llama3 import Transformer

    model, args = _model()
    expected = adapter.to_hf(model.state_dict(), args)
    out = export_hf_sharded(model, tmp_path / "small", "llama3", "debugmodel", torch.float32, args,
                            max_shard_size="40KB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(index["weight_map"]) == sorted(expected) == list(index["weight_map"])
    assert index["metadata"] == {"total_size": sum(t.numel() * 4 for t in expected.values())}
    back = Transformer(args)
    load_hf_sharded(back, out, "llama3", "debugmodel", args)
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name

    whole = export_hf_sharded(model, tmp_path / "whole", "llama3", "debugmodel", torch.float32, args)
    index = json.loads((whole / "model.safetensors.index.json").read_text())  # an index for one file too
    assert set(index["weight_map"].values()) == {"model-00001-of-00001.safetensors"}


def _export_on_rank(rank, world, out):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.checkpoint.hf_sharded import export_hf_sharded

    model, args = _model()
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    export_hf_sharded(model, out, "llama3", "debugmodel", torch.float32, args, max_shard_size="40KB")


def test_two_writers_number_their_files_in_one_sequence(tmp_path):
    from safetensors.torch import load_file

    from plait.models.hf import llama3 as adapter
    from plait.testing import run_on_ranks

    model, args = _model()
    expected = adapter.to_hf(model.state_dict(), args)
    out = tmp_path / "export"
    run_on_ranks(_export_on_rank, 2, str(out), timeout=120)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files == [f"model-{i:05d}-of-{len(files):05d}.safetensors" for i in range(1, len(files) + 1)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files  # no gap, no stray file
    written = {}
    for file in files:
        written.update({name: (file, t) for name, t in load_file(out / file).items()})
    assert {name: file for name, (file, _) in written.items()} == index["weight_map"]
    for name, tensor in expected.items():
        assert torch.equal(written[name][1], tensor), name


def test_a_tied_head_round_trips_a_layer_at_a_time(tmp_path):
    """Llama 3.2's tied embedding and head: exported once (as the embedding), loaded a layer at a
    time into both names, still one tensor (the adapter used to require the embedding in every
    part of the folder it was given)."""
    from plait.checkpoint.hf_sharded import export_hf_sharded, load_hf_sharded
    from plait.models.llama3 import FLAVORS, Transformer

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=2, dim=64, n_heads=4, n_kv_heads=4, vocab_size=256,
                               tie_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    out = export_hf_sharded(model, tmp_path / "tied", "llama3", "debugmodel", torch.float32, args)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    loaded = Transformer(args)
    load_hf_sharded(loaded, out, "llama3", "debugmodel", args)
    assert loaded.output.weight is loaded.tok_embeddings.weight
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
