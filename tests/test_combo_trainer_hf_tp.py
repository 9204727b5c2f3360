"""Hugging Face weights into a tensor-parallel run (the layer-at-a-time sharded import slicing
colwise / rowwise DTensors): TP 2 from the same HF folder trains with the 1-rank losses, and its
export from both ranks (index + one shard per rank) holds the trained weights of the 1-rank run."""

import json

import pytest
import torch

from plait.testing.trainer import losses, run_cli

# fmt: off
COMMON = [
    "--training.steps", "3",
    "--training.seq_len", "64",
    "--training.local_batch_size", "4",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--metrics.log_freq", "3",
    "--metrics.cpu_peak_tflops", "0.1",
    "--checkpoint.enable", "true",
    "--checkpoint.last_save_in_hf", "true",
    "--checkpoint.export_dtype", "float32",
]
# fmt: on


def test_tp2_from_hf_weights_matches_one_rank(tmp_path):
    from plait.models.hf.io import save_safetensors
    from plait.models.hf.llama3 import hf_config, to_hf
    from plait.models.llama3 import FLAVORS, Transformer

    args = FLAVORS["debugmodel"]
    torch.manual_seed(3)
    model = Transformer(args)
    model.init_weights()
    hf = tmp_path / "hf"
    save_safetensors(to_hf(model.state_dict(), args), hf, max_shard_size="4MB")
    (hf / "config.json").write_text(json.dumps(hf_config(args)))
    start = ["--checkpoint.initial_load_path", str(hf), "--checkpoint.initial_load_hf", "true"]
    run_cli(tmp_path / "one", *COMMON, *start)
    result = run_cli(tmp_path / "tp2", *COMMON, *start, "--nproc-per-node", "2", "--parallelism.tp", "2", timeout=300)
    assert "initial weights from Hugging Face" in result.stdout
    assert losses(tmp_path / "tp2") == pytest.approx(losses(tmp_path / "one"), abs=1e-5, rel=0)
    from safetensors.torch import load_file

    exports = {}
    for run in ("one", "tp2"):
        folder = tmp_path / run / "checkpoints" / "hf-step-000003"
        index = json.loads((folder / "model.safetensors.index.json").read_text())
        exports[run] = {k: v for f in sorted(set(index["weight_map"].values())) for k, v in load_file(folder / f).items()}
    assert len(set(json.loads((tmp_path / "tp2" / "checkpoints" / "hf-step-000003" /
                               "model.safetensors.index.json").read_text())["weight_map"].values())) == 2
    assert exports["one"].keys() == exports["tp2"].keys()
    for name, tensor in exports["one"].items():
        torch.testing.assert_close(exports["tp2"][name], tensor, atol=1e-5, rtol=1e-5)
