"""Qwen3 and Qwen3-MoE folders written by transformers (tiny configs built here, fp32, sharded files)
into plait-train's model a layer at a time, and back out: one process, and FSDP 2 on gloo ranks
(each rank reads its own slices). The logits are transformers' own; the export loads in transformers."""

import dataclasses
import json

import pytest
import torch

from plait.testing import run_on_ranks

transformers = pytest.importorskip("transformers")

# The debug flavors at 2 blocks (a folder must be the run's flavor, with its overrides).
OVERRIDES = dict(n_layers=2, vocab_size=2048)


def _args(flavor: str):
    from plait.models.qwen3 import FLAVORS

    return dataclasses.replace(FLAVORS[flavor], **OVERRIDES)


def _write_hf_folder(path, flavor: str):
    """A random transformers model of the flavor's config, saved as transformers saves it."""
    from plait.models.hf import qwen3 as adapter

    args = _args(flavor)
    config = {k: v for k, v in adapter.hf_config(args).items() if k not in ("architectures", "model_type")}
    cls = transformers.Qwen3MoeForCausalLM if args.is_moe else transformers.Qwen3ForCausalLM
    config_cls = transformers.Qwen3MoeConfig if args.is_moe else transformers.Qwen3Config
    torch.manual_seed(0)
    hf = cls(config_cls(**config)).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.2)  # per-head norms that matter: a wrong rotary order shows
            elif "experts" in name or name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.05)
    hf.save_pretrained(path, max_shard_size="2MB")
    return hf


def _load_and_export(model, hf_dir, out_dir, flavor):
    from plait.checkpoint.hf_sharded import export_hf_sharded, load_hf_sharded

    load_hf_sharded(model, hf_dir, "qwen3", flavor, _args(flavor))
    export_hf_sharded(model, out_dir, "qwen3", flavor, torch.float32, _args(flavor))


def _rank(rank, world, hf_dir, out_dir, flavor, tokens):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.models.qwen3 import Transformer

    with torch.device("meta"):
        model = Transformer(_args(flavor))
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()  # overwritten by the load; makes the RoPE tables real
    _load_and_export(model, hf_dir, out_dir, flavor)
    with torch.no_grad():
        return model(tokens)


@pytest.mark.parametrize("flavor", ["debugmodel", "debugmodel_moe"])
def test_transformers_folder_in_and_out_one_process_and_fsdp_2(tmp_path, flavor):
    from plait.models.qwen3 import Transformer

    hf = _write_hf_folder(tmp_path / "hf", flavor)
    tokens = torch.randint(0, 2048, (2, 24))
    with torch.no_grad():
        expected = hf(tokens).logits

    model = Transformer(_args(flavor))
    _load_and_export(model, tmp_path / "hf", tmp_path / "out1", flavor)
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), expected, atol=1e-5, rtol=1e-5)
    for logits in run_on_ranks(_rank, 2, str(tmp_path / "hf"), str(tmp_path / "out2"), flavor, tokens, timeout=120):
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)

    for out in ("out1", "out2"):  # both exports are transformers' model again
        assert json.loads((tmp_path / out / "config.json").read_text())["architectures"] == [type(hf).__name__]
        back = type(hf).from_pretrained(tmp_path / out, dtype=torch.float32).eval()
        with torch.no_grad():
            torch.testing.assert_close(back(tokens).logits, expected, atol=1e-5, rtol=1e-5)
