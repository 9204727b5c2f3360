"""Sharded HF weights on 4 gloo ranks (one spawn): a 216 MB (fp32) Llama saved as bf16, as released
checkpoints are, loaded a layer at a time into FSDP 4 gives the 1-rank logits and takes well under
the full load's host memory per rank;
exported from all 4 ranks it is an index + shards that transformers loads with the same logits."""

import json

import pytest
import torch

from plait.testing import run_on_ranks

WORLD = 4
SHAPE = dict(dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=4096, multiple_of=256, max_seq_len=64)


def _args():
    from plait.models.llama3 import ModelArgs

    return ModelArgs(**SHAPE)


def _rss_kib(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _measure(fn) -> tuple[float, float]:
    """(peak RSS while fn runs, RSS before it) in MiB, from a reset high-water mark."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS
    before = _rss_kib("VmRSS") / 1024
    fn()
    return _rss_kib("VmHWM") / 1024, before


def _sharded_model(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.models.llama3 import Transformer

    with torch.device("meta"):
        model = Transformer(_args())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    model.init_weights()  # overwritten by the load; makes buffers (RoPE) real
    return model


def _rank(rank, world, hf_dir, out_dir, tokens):
    import ctypes
    import gc

    # Tensors over 64 KiB get their own mapping, returned to the OS when freed, so RSS follows the
    # live memory of each phase (glibc would otherwise keep freed heap for the next phase).
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from plait.checkpoint import hf_export, hf_sharded

    model = _sharded_model(world)
    gc.collect()
    sharded = _measure(lambda: hf_sharded.load_hf_sharded(model, hf_dir, "llama3", "debugmodel", _args()))
    with torch.no_grad():
        logits = model(tokens)
    hf_sharded.export_hf_sharded(model, out_dir, "llama3", "debugmodel", torch.float32, _args())

    def full_load():  # the previous path (trainer before issue 14): every rank converts the whole model
        full = hf_export.read_hf_state(hf_dir, "llama3", "debugmodel", _args())
        dtypes = {name: t.dtype for name, t in model.state_dict().items()}
        full = {name: t.to(dtypes[name]) for name, t in full.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))

    gc.collect()
    full = _measure(full_load)
    return logits, sharded, full


@pytest.mark.timeout(300)
def test_sharded_import_and_export_on_4_ranks(tmp_path):
    from plait.models.hf.io import save_safetensors
    from plait.models.hf.llama3 import hf_config, to_hf
    from plait.models.llama3 import Transformer

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    reference = Transformer(_args())
    reference.init_weights()
    with torch.no_grad():  # bf16 weights, as released checkpoints are; the fp32 model holds them exactly
        for p in reference.parameters():
            p.copy_(p.to(torch.bfloat16))
    hf_dir, out_dir = tmp_path / "hf", tmp_path / "export"
    save_safetensors(to_hf(reference.state_dict(), _args()), hf_dir, max_shard_size="20MB", dtype=torch.bfloat16)
    (hf_dir / "config.json").write_text(json.dumps(hf_config(_args())))
    nbytes = sum(t.numel() * 4 for t in reference.state_dict().values())
    assert 150e6 < nbytes < 400e6  # a few hundred MB
    tokens = torch.randint(0, SHAPE["vocab_size"], (2, 16))
    with torch.no_grad():
        expected = reference(tokens)
    del reference
    results = run_on_ranks(_rank, WORLD, str(hf_dir), str(out_dir), tokens, timeout=280)
    for logits, _, _ in results:
        torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    sharded = max(r[1][0] for r in results)
    full = min(r[2][0] for r in results)
    # What the load itself adds to a rank (peak - RSS before; the process's torch and its model
    # shard are there either way): about one layer, against the whole model and its conversion.
    sharded_added = max(peak - before for _, (peak, before), _ in results)
    full_added = min(peak - before for _, _, (peak, before) in results)
    print(f"peak RSS per rank while loading {nbytes / 2**20:.0f} MiB on {WORLD} ranks: layer-wise sharded "
          f"{sharded:.0f} MiB (+{sharded_added:.0f} by the load), full load {full:.0f} MiB (+{full_added:.0f}); "
          f"ratio {sharded / full:.2f}x peak, {sharded_added / full_added:.2f}x added")
    assert sharded < 0.65 * full and sharded_added < 0.2 * full_added
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == WORLD  # every rank wrote a shard
    hf = transformers.AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, expected, atol=1e-4, rtol=1e-4)


def test_fp8_release_format_through_the_trainer_import(tmp_path):
    """One process, no process group: DeepSeek-V3 weights as released (FP8 + weight_scale_inv,
    sharded files) load into the model dequantised; renamed-only tensors come through slices."""
    import dataclasses

    from plait.checkpoint.hf_sharded import load_hf_sharded
    from plait.models.deepseek_v3 import FLAVORS, Transformer
    from plait.models.hf import deepseek_v3 as adapter
    from plait.models.hf.io import save_safetensors

    args = dataclasses.replace(FLAVORS["debugmodel"], score_func="sigmoid")
    torch.manual_seed(0)
    source = Transformer(args)
    source.init_weights()
    written, expected = {}, {}
    for name, w in adapter.to_hf(source.state_dict(), args).items():
        if name.endswith("proj.weight"):  # quantised as released: one scale per 128 x 128 block
            rows, cols = -(-w.shape[0] // 128), -(-w.shape[1] // 128)
            padded = torch.zeros(rows * 128, cols * 128)
            padded[: w.shape[0], : w.shape[1]] = w
            amax = padded.view(rows, 128, cols, 128).abs().amax(dim=(1, 3))
            scale = amax.clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max  # [rows, cols]
            scale_full = scale.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
            q = (w / scale_full).to(torch.float8_e4m3fn)
            written[name], written[name.replace(".weight", ".weight_scale_inv")] = q, scale
            expected[name] = q.float() * scale_full
        else:
            written[name] = expected[name] = w
    save_safetensors(written, tmp_path, max_shard_size="1MB")
    config = adapter.hf_config(args)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = Transformer(args)
    load_hf_sharded(model, tmp_path, "deepseek_v3", "debugmodel", args)
    want = adapter.from_hf(expected, args)
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name
