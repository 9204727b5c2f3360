"""`plait-convert` in a subprocess: plait model.pt -> HF directory -> plait again."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from plait.models.hf.convert import main

CONVERT = (
    [shutil.which("plait-convert")]
    if shutil.which("plait-convert")
    else [sys.executable, "-m", "plait.models.hf.convert"]
)


def run(*argv: str):
    subprocess.run([*CONVERT, *argv], check=True, capture_output=True, text=True, timeout=120)


def tiny_debugmodel_state_dict():
    from plait.models import build_model

    torch.manual_seed(0)
    model = build_model("llama3", "debugmodel", n_layers=1, vocab_size=256)
    model.init_weights()
    return model.state_dict()


def test_round_trip_through_the_cli(tmp_path):
    state_dict = tiny_debugmodel_state_dict()
    torch.save(state_dict, tmp_path / "model.pt")
    common = ["--model", "llama3"]
    run(
        "to-hf",
        *common,
        "--flavor",
        "debugmodel",
        "--set",
        "n_layers=1",
        "--set",
        "vocab_size=256",
        "--input",
        str(tmp_path),
        "--output",
        str(tmp_path / "hf"),
        "--dtype",
        "bfloat16",
        "--max-shard-size",
        "1MB",
    )
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert (config["num_hidden_layers"], config["vocab_size"], config["torch_dtype"]) == (1, 256, "bfloat16")
    shard = next((tmp_path / "hf").glob("model-00001-of-*.safetensors"))
    with safe_open(shard, "pt") as f:
        assert f.get_tensor(next(iter(f.keys()))).dtype == torch.bfloat16

    run(
        "from-hf", *common, "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back.pt"), "--dtype", "float32"
    )
    back = torch.load(tmp_path / "back.pt", weights_only=True)
    assert back.keys() == state_dict.keys()
    for name, tensor in state_dict.items():
        torch.testing.assert_close(back[name], tensor.bfloat16().float(), rtol=0, atol=0, msg=name)


def test_from_hf_to_safetensors_file(tmp_path):
    state_dict = tiny_debugmodel_state_dict()
    torch.save({"model": state_dict}, tmp_path / "ckpt.pt")  # trainer-style {"model": ...} is accepted
    overrides = ["--set", "n_layers=1", "--set", "vocab_size=256"]
    main(
        [
            "to-hf",
            "--model",
            "llama3",
            "--flavor",
            "debugmodel",
            *overrides,
            "--input",
            str(tmp_path / "ckpt.pt"),
            "--output",
            str(tmp_path / "hf"),
        ]
    )
    main(["from-hf", "--model", "llama3", "--input", str(tmp_path / "hf"), "--output", str(tmp_path / "p.safetensors")])
    main(
        [
            "to-hf",
            "--model",
            "llama3",
            "--flavor",
            "debugmodel",
            *overrides,
            "--input",
            str(tmp_path / "p.safetensors"),
            "--output",
            str(tmp_path / "hf2"),
        ]
    )
    assert (tmp_path / "hf" / "model.safetensors").read_bytes() == (tmp_path / "hf2" / "model.safetensors").read_bytes()


def test_mismatched_state_dict_is_refused(tmp_path):
    torch.save(tiny_debugmodel_state_dict(), tmp_path / "model.pt")
    with pytest.raises(ValueError, match="does not match"):
        main(
            [
                "to-hf",
                "--model",
                "llama3",
                "--flavor",
                "debugmodel",
                "--input",
                str(tmp_path),
                "--output",
                str(tmp_path / "hf"),
            ]
        )
