"""Seed checkpoints, Hugging Face export and import, in real `plait-train` processes.

A seed checkpoint made on one process starts a 2-rank run whose own init is sharded (so not the
1-rank init): its losses match the 1-rank run, which shows the weights came from the seed. That
run's final checkpoint is exported to safetensors and loaded by `transformers` with the same
logits as plait's model read from the checkpoint; a run started from those HF weights holds them
exactly.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from plait.testing.trainer import cli_env, losses, run_cli
from plait.trainer.checkpoint import hf_export

STEPS = 6
# fmt: off
COMMON = [
    "--training.steps", str(STEPS),
    "--training.seq_len", "64",
    "--training.dtype", "float32",
    "--training.deterministic", "true",
    "--lr_scheduler.warmup_steps", "2",
    "--optimizer.lr", "3e-3",
    "--metrics.log_freq", "3",
    "--metrics.cpu_peak_tflops", "0.1",
    "--metrics.tensorboard", "false",
]
# fmt: on


def run(dump: Path, *args, timeout=240) -> subprocess.CompletedProcess:
    return run_cli(dump, *COMMON, *args, timeout=timeout)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    seed = root / "seed"
    result = run(seed, "--checkpoint.create_seed_checkpoint", "true")
    assert "seed checkpoint" in result.stdout and not (seed / "metrics.jsonl").exists()
    baseline = root / "one_rank"
    run(baseline, "--training.local_batch_size", "2")
    trained = root / "from_seed"
    result = run(
        trained,
        "--nproc-per-node", "2",
        "--training.local_batch_size", "1",
        "--model.init", "sharded",  # on its own, not the 1-rank init
        "--checkpoint.initial_load_path", str(seed / "checkpoints" / "step-000000"),
        "--checkpoint.enable", "true",
        "--checkpoint.last_save_in_hf", "true",
        "--checkpoint.export_dtype", "float32",
    )  # fmt: skip
    assert "initial weights from" in result.stdout
    return {"seed": seed, "baseline": baseline, "trained": trained}


def test_seed_checkpoint_is_the_seeded_init_model_only(runs):
    from plait.models import build_model

    path = runs["seed"] / "checkpoints" / "step-000000"
    marker = json.loads((path / ".complete").read_text())
    assert marker["model_only"] and marker["step"] == 0 and marker["world_size"] == 1
    state, _ = hf_export.read_model_state(path)
    with torch.device("meta"):
        model = build_model("llama3", "debugmodel")
    model.to_empty(device="cpu")
    torch.manual_seed(0)  # job.seed
    model.init_weights()
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


def test_run_from_seed_on_another_layout_matches_one_rank(runs):
    assert losses(runs["trained"]) == pytest.approx(losses(runs["baseline"]), abs=1e-5, rel=0)


def test_export_loads_in_transformers_with_the_same_logits(runs, tmp_path):
    transformers = pytest.importorskip("transformers")
    from plait.models import build_model

    checkpoint = runs["trained"] / "checkpoints" / f"step-{STEPS:06d}"
    out = tmp_path / "hf32"
    result = subprocess.run(
        [sys.executable, "-m", "plait.trainer.checkpoint.hf_export", "--checkpoint", str(checkpoint),
         "--output", str(out), "--dtype", "float32"],
        capture_output=True, text=True, timeout=120, env=cli_env(),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "llama3 debugmodel, step 6, float32" in result.stdout

    state, _ = hf_export.read_model_state(checkpoint)
    model = build_model("llama3", "debugmodel")
    model.load_state_dict(state, strict=True)
    hf_model = transformers.LlamaForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tokens = torch.randint(0, 2048, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf_model(tokens).logits, model(tokens), atol=1e-5, rtol=1e-5)

    # last_save_in_hf wrote the same tensors at the end of the run
    from plait.models.hf.io import load_safetensors

    at_end, exported = load_safetensors(checkpoint.with_name(f"hf-step-{STEPS:06d}")), load_safetensors(out)
    assert at_end.keys() == exported.keys() and all(torch.equal(at_end[k], exported[k]) for k in at_end)

    # bfloat16 export
    out16 = tmp_path / "hf16"
    assert hf_export.main(["--checkpoint", str(checkpoint), "--output", str(out16)]) == 0
    assert {t.dtype for t in load_safetensors(out16).values()} == {torch.bfloat16}
    assert json.loads((out16 / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_run_started_from_hf_weights_holds_them(runs, tmp_path):
    checkpoint = runs["trained"] / "checkpoints" / f"step-{STEPS:06d}"
    hf_dir = checkpoint.with_name(f"hf-step-{STEPS:06d}")
    # From HF weights straight into a seed checkpoint: the model the run starts from, saved by DCP.
    dump = tmp_path / "from_hf"
    result = run(
        dump,
        "--checkpoint.create_seed_checkpoint", "true",
        "--checkpoint.initial_load_path", str(hf_dir),
        "--checkpoint.initial_load_hf", "true",
    )  # fmt: skip
    assert "initial weights from Hugging Face" in result.stdout
    loaded, _ = hf_export.read_model_state(dump / "checkpoints" / "step-000000")
    trained, _ = hf_export.read_model_state(checkpoint)
    assert loaded.keys() == trained.keys()
    for name in trained:
        assert torch.equal(loaded[name], trained[name]), name
    # ... and a 2-rank FSDP run trains from them.
    dump2 = tmp_path / "from_hf_2"
    result = run(
        dump2,
        "--nproc-per-node", "2",
        "--training.local_batch_size", "1",
        "--training.steps", "2",
        "--checkpoint.initial_load_path", str(hf_dir),
        "--checkpoint.initial_load_hf", "true",
    )  # fmt: skip
    assert losses(dump2)[0] < losses(runs["baseline"])[0] - 0.5  # trained weights: a lower first loss


def test_export_of_a_corrupt_checkpoint_names_it(runs, tmp_path):
    checkpoint = runs["seed"] / "checkpoints" / "step-000000"
    broken = tmp_path / "step-000003"
    broken.mkdir()
    for f in checkpoint.iterdir():
        if f.name != ".complete":
            (broken / f.name).write_bytes(f.read_bytes())
    assert hf_export.main(["--checkpoint", str(broken), "--output", str(tmp_path / "x")]) == 2
