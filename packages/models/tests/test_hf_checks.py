"""Issue 27: what plait-convert and the trainer import refuse (defect 3, 8), and the file mode of
what they write (exported safetensors were 0600: others could not read them)."""

import os

import pytest
import torch

from plait.models.hf.checks import ImportCheckError, check_hf_state
from plait.models.hf.io import save_safetensors, save_safetensors_file


def test_check_hf_state():
    good = {"a.weight": torch.ones(2, 2), "b.weight": torch.ones(2, 2, dtype=torch.bfloat16)}
    check_hf_state(good, "model.safetensors")
    fp8 = {"q.weight": torch.ones(2, 2).to(torch.float8_e4m3fn)}
    with pytest.raises(ImportCheckError, match="q.weight in f is torch.float8_e4m3fn but has no q.weight_scale_inv"):
        check_hf_state(fp8, "f")
    check_hf_state({**fp8, "q.weight_scale_inv": torch.ones(1, 1)}, "f")
    with pytest.raises(ImportCheckError, match="w in f is torch.int32, not a floating-point weight"):
        check_hf_state({"w": torch.ones(2, dtype=torch.int32)}, "f")
    with pytest.raises(ImportCheckError, match="w in f holds 1 NaN/Inf values of 2"):
        check_hf_state({"w": torch.tensor([1.0, float("inf")])}, "f")


def test_written_files_follow_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        files = save_safetensors({"a": torch.ones(4), "b": torch.ones(4)}, tmp_path / "sharded", max_shard_size=16)
        files.append(save_safetensors_file({"a": torch.ones(2)}, tmp_path / "one.safetensors"))
        assert len(files) == 3
        for file in files:
            assert oct(os.stat(file).st_mode & 0o777) == "0o644", file
        os.umask(0o077)
        private = save_safetensors_file({"a": torch.ones(2)}, tmp_path / "private.safetensors")
        assert oct(os.stat(private).st_mode & 0o777) == "0o600"
    finally:
        os.umask(old)


def test_convert_from_hf_refuses_an_fp8_weight_without_scale(tmp_path, capsys):
    import json

    from plait.models.hf import llama3 as adapter
    from plait.models.hf.convert import main
    from plait.models.llama3 import FLAVORS, Transformer

    args = FLAVORS["debugmodel"]
    model = Transformer(args)
    model.init_weights()
    hf = {k: v.clone() for k, v in adapter.to_hf(model.state_dict(), args).items()}
    name = "model.layers.0.self_attn.o_proj.weight"
    hf[name] = hf[name].to(torch.float8_e4m3fn)
    save_safetensors(hf, tmp_path / "hf")
    (tmp_path / "hf" / "config.json").write_text(json.dumps(adapter.hf_config(args)))
    assert main(["from-hf", "--model", "llama3", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "o.pt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"plait-convert: error: {name} in ") and "has no" in err and "\n" not in err
    assert not (tmp_path / "o.pt").exists()
