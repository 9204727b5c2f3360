"""Hugging Face weights that cannot become model weights as they are (issue 27, defects 3 and 8):
each is one CheckpointError (exit 2) naming the tensor and its file, never a silent cast, a raw
FP8 load, a SafetensorError trace or a NaN blamed on the learning rate. Real safetensors files,
read by the trainer's sharded import in this process (no process group)."""

import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from plait.checkpoint.store import CheckpointError


def _llama_folder(tmp_path, change=None, index=False):
    """A 1-layer Llama HF folder; `change(hf_state_dict)` damages it before it is written."""
    from plait.models.hf import llama3 as adapter
    from plait.models.llama3 import FLAVORS, Transformer

    args = dataclasses.replace(FLAVORS["debugmodel"], n_layers=1, dim=64, n_heads=4, n_kv_heads=4, vocab_size=256)
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    hf = {k: v.clone() for k, v in adapter.to_hf(model.state_dict(), args).items()}
    if change:
        change(hf)
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    if index:  # two files and an index naming them
        names = sorted(hf)
        first, second = names[: len(names) // 2], names[len(names) // 2 :]
        save_file({k: hf[k] for k in first}, str(folder / "model-00001-of-00002.safetensors"))
        save_file({k: hf[k] for k in second}, str(folder / "model-00002-of-00002.safetensors"))
        weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
        weight_map.update({k: "model-00002-of-00002.safetensors" for k in second})
        weight_map.update(index)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    else:
        save_file(hf, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    return folder, Transformer(args), args


def _load(folder, model, args, name="llama3", flavor="debugmodel"):
    from plait.checkpoint.hf_sharded import load_hf_sharded

    load_hf_sharded(model, folder, name, flavor, args)


def _error(tmp_path, change=None, index=False) -> str:
    folder, model, args = _llama_folder(tmp_path, change, index)
    with pytest.raises(CheckpointError) as info:
        _load(folder, model, args)
    message = str(info.value)
    assert "\n" not in message and message.startswith("checkpoint.initial_load_path = "), message
    return message


def _fp8(hf, name):
    hf[name] = hf[name].to(torch.float8_e4m3fn)


def test_fp8_weight_without_its_scale_is_refused(tmp_path):
    # q_proj goes through the RoPE permutation (read whole), o_proj is a rename (read as a slice):
    # both paths took the raw FP8 codes as the weight before.
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.o_proj.weight",
                 "model.layers.0.mlp.down_proj.weight"):
        message = _error(tmp_path / name, lambda hf, name=name: _fp8(hf, name))
        assert f"{name} in model.safetensors is torch.float8_e4m3fn but has no {name}_scale_inv" in message


def test_integer_weight_is_refused_not_cast(tmp_path):
    for name in ("model.norm.weight", "model.layers.0.self_attn.k_proj.weight"):
        def change(hf, name=name):
            hf[name] = hf[name].to(torch.int32)
        message = _error(tmp_path / name, change)
        assert f"{name} in model.safetensors is torch.int32, not a floating-point weight" in message


def test_wrong_shape_names_tensor_and_file(tmp_path):
    def change(hf):
        hf["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    message = _error(tmp_path, change)
    assert "model.layers.0.self_attn.o_proj.weight in model.safetensors (shape (64, 32)) does not fit" in message


def test_wrong_shape_in_a_transformed_tensor_is_one_line(tmp_path):
    """q_proj goes through the RoPE permutation (read whole): a wrong shape there is one line
    naming it too, not the permutation's traceback (issue 40 fault probe 7)."""
    def change(hf):
        hf["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(50, 64)  # breaks the permutation's view
    message = _error(tmp_path, change)
    assert "model.layers.0.self_attn.q_proj.weight in model.safetensors (shape (50, 64)) does not fit" in message


def test_layers_past_the_config_are_refused_not_skipped(tmp_path):
    """Tensors of a layer config.json does not describe: refused in one line (they were skipped
    without a word; issue 40 fault probe 14)."""
    def change(hf):
        hf["model.layers.3.input_layernorm.weight"] = torch.ones(64)
    message = _error(tmp_path, change)
    assert "holds tensors of layer 3, past its config.json's num_hidden_layers = 1" in message, message


def test_index_naming_a_tensor_its_file_lacks_or_a_missing_file(tmp_path):
    # The index says model.norm.weight is in the first file; it is in the second.
    norm = "model.norm.weight"
    message = _error(tmp_path / "a", index={norm: "model-00001-of-00002.safetensors"})
    assert f"cannot read {norm} from model-00001-of-00002.safetensors (File does not contain tensor" in message
    message = _error(tmp_path / "b", index={norm: "model-00003-of-00002.safetensors"})
    assert f"{norm} is in model-00003-of-00002.safetensors, which does not exist" in message
    rope = "model.layers.0.self_attn.q_proj.weight"  # read whole (RoPE rows permuted), not as a slice
    message = _error(tmp_path / "c", index={rope: "model-00003-of-00002.safetensors"})
    assert f"{rope} is in model-00003-of-00002.safetensors, which does not exist" in message


def test_nan_in_imported_weights_is_named_not_a_divergence(tmp_path):
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        def change(hf, name=name):
            hf[name][3, 5] = float("nan")
            hf[name][1, 1] = float("inf")
        message = _error(tmp_path / name, change)
        assert f"{name} in model.safetensors holds 2 NaN/Inf values" in message
        assert "the weights are damaged, not the training" in message


def test_deepseek_shared_expert_fp8_without_scale(tmp_path):
    """The release format with one shared-expert scale lost: refused (routed experts already were)."""
    from plait.models.deepseek_v3 import FLAVORS, Transformer
    from plait.models.hf import deepseek_v3 as adapter

    args = dataclasses.replace(FLAVORS["debugmodel"], score_func="sigmoid", n_layers=2, dim=64, inter_dim=128,
                               moe_inter_dim=32, n_heads=2, kv_lora_rank=32, qk_nope_head_dim=16,
                               qk_rope_head_dim=16, v_head_dim=16, vocab_size=256)
    torch.manual_seed(0)
    source = Transformer(args)
    source.init_weights()
    hf = {}
    for name, w in adapter.to_hf(source.state_dict(), args).items():
        if name.endswith("proj.weight"):
            hf[name] = w.contiguous().to(torch.float8_e4m3fn)
            hf[name + "_scale_inv"] = torch.ones(-(-w.shape[0] // 128), -(-w.shape[1] // 128))
        else:
            hf[name] = w
    lost = "model.layers.1.mlp.shared_experts.down_proj.weight"
    del hf[lost + "_scale_inv"]
    save_file(hf, str(tmp_path / "model.safetensors"))
    config = dict(adapter.hf_config(args), quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]})
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=f"{lost} in model.safetensors is torch.float8_e4m3fn but has no"):
        _load(tmp_path, Transformer(args), args, "deepseek_v3", "debugmodel")


def test_exported_files_are_readable_by_others(tmp_path):
    """checkpoint.last_save_in_hf's writer: mode 0644 under umask 022 (safetensors writes 0600)."""
    import os

    from plait.checkpoint.hf_sharded import export_hf_sharded

    folder, model, args = _llama_folder(tmp_path)
    _load(folder, model, args)
    old = os.umask(0o022)
    try:
        out = export_hf_sharded(model, tmp_path / "export", "llama3", "debugmodel", torch.float32, args)
    finally:
        os.umask(old)
    files = sorted(out.iterdir())
    assert any(f.suffix == ".safetensors" for f in files)
    for file in files:
        assert oct(file.stat().st_mode & 0o777) == "0o644", file
