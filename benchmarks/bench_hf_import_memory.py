"""Peak host memory per rank while importing Hugging Face weights into an FSDP model: the previous
path (every rank reads the whole checkpoint, converts it, casts it to the parameters' dtype and
scatters it with set_model_state_dict(full_state_dict=True)) against the layer-at-a-time sharded
import (`plait.checkpoint.hf_sharded.load_hf_sharded`).

    python benchmarks/bench_hf_import_memory.py                 # 1, 2, 4 ranks

The checkpoint is a Llama of 216 MiB in fp32 (dim 768, 8 layers, vocab 4096) saved in bf16 like
released checkpoints (108 MiB of safetensors in 20 MB shards). Each (method, ranks) runs in fresh
processes; a rank's peak is its VmHWM after resetting it just before the load, with glibc told to
return large frees at once (mallopt M_MMAP_THRESHOLD) so RSS follows live memory.
"""

import argparse
import json
import tempfile
from pathlib import Path

import torch

from plait.testing import run_on_ranks

SHAPE = dict(dim=768, n_layers=8, n_heads=12, n_kv_heads=4, vocab_size=4096, multiple_of=256, max_seq_len=64)


def _args():
    from plait.models.llama3 import ModelArgs

    return ModelArgs(**SHAPE)


def _kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(field)


def _rank(rank, world, hf_dir, method):
    import ctypes
    import gc

    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from plait.checkpoint import hf_export, hf_sharded
    from plait.models.llama3 import Transformer

    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)
    with torch.device("meta"):
        model = Transformer(_args())
    mesh = init_device_mesh("cpu", (world,))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _kib("VmRSS")
    if method == "sharded":
        hf_sharded.load_hf_sharded(model, hf_dir, "llama3", "debugmodel", _args())
    else:
        full = hf_export.read_hf_state(hf_dir, "llama3", "debugmodel", _args())
        dtypes = {name: t.dtype for name, t in model.state_dict().items()}
        full = {name: t.to(dtypes[name]) for name, t in full.items()}
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=True))
    return _kib("VmHWM") / 1024, before / 1024


def main():
    from plait.models.hf.io import save_safetensors
    from plait.models.hf.llama3 import hf_config, to_hf
    from plait.models.llama3 import Transformer

    parser = argparse.ArgumentParser()
    parser.add_argument("--ranks", default="1,2,4")
    ns = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir = Path(tmp) / "hf"
        model = Transformer(_args())
        model.init_weights()
        save_safetensors(to_hf(model.state_dict(), _args()), hf_dir, max_shard_size="20MB", dtype=torch.bfloat16)
        (hf_dir / "config.json").write_text(json.dumps(hf_config(_args())))
        fp32 = sum(t.numel() * 4 for t in model.state_dict().values()) / 2**20
        del model
        print(f"model {fp32:.0f} MiB fp32, checkpoint bf16; MiB per rank (max over ranks)")
        print("| ranks | before: peak RSS | before: added by the load | after: peak RSS | after: added by the load |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        for world in [int(x) for x in ns.ranks.split(",")]:
            row = []
            for method in ("full", "sharded"):
                results = run_on_ranks(_rank, world, str(hf_dir), method, timeout=300)
                row += [max(p for p, _ in results), max(p - b for p, b in results)]
            print(f"| {world} | {row[0]:.0f} | {row[1]:.0f} | {row[2]:.0f} | {row[3]:.0f} |", flush=True)


if __name__ == "__main__":
    main()
