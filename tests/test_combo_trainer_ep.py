"""The trainer with expert parallel (dp2ep) on DeepSeek-V3 debug (8 routed experts, top-3):
capacity mode drops and counts tokens, checkpoints reshard across EP degrees and export every
expert, the balancing bias stays identical on every rank, the sequence-wise aux loss is exact
under CP x TP x EP, and bad EP layouts fail before any collective with one line. (Parity of every
EP layout with one rank: test_combo_parity_matrix.py.)"""

import shutil
from pathlib import Path

import pytest
import torch

from plait.testing.trainer import losses, parity_args, read_metrics, run_cli
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate

MOE_LAYERS = 5  # debugmodel: 6 layers, the first dense
COMMON = ["--model.name", "deepseek_v3", "--model.flavor", "debugmodel", *parity_args(steps=4)]
# Resharding runs: every step saved, an fp32 HF export at the end (which needs sigmoid routing,
# the scores HF's DeepseekV3 computes). A slimmer attention and 2 MoE layers: the debug model's
# checkpoint is 400 MB, and the resharding chain writes a dozen of them.
SAVES = ["--model.score_func", "sigmoid", "--checkpoint.enable", "true", "--checkpoint.interval", "1",
         "--checkpoint.last_save_in_hf", "true", "--checkpoint.export_dtype", "float32",
         "--model.n_layers", "3", "--model.kv_lora_rank", "64", "--model.qk_nope_head_dim", "32",
         "--model.v_head_dim", "32"]
SAVED_MOE_LAYERS = 2


def test_capacity_mode_drops_and_counts_tokens_over_capacity(tmp_path):
    result = run_cli(
        tmp_path, *COMMON, "--training.local_batch_size", "2", "--nproc-per-node", "2", "--parallelism.ep", "2",
        "--parallelism.expert_capacity_factor", "0.5", timeout=300,
    )
    dropped = int(result.stdout.split("expert capacity dropped ")[1].split()[0])
    assert dropped > 0
    assert sum(r["moe_dropped"] for r in read_metrics(tmp_path)) == dropped  # per step in metrics.jsonl
    assert all(loss == loss for loss in losses(tmp_path))  # trains (finite losses) with tokens dropped


@pytest.mark.parametrize(
    "parallelism, world, message",
    [
        ({"dp_shard": 16, "ep": 16}, 16, "parallelism.ep = 16 does not divide the 8 routed experts"),
        ({"dp_shard": 2, "tp": 4, "ep": 4, "etp": 2}, 8, "parallelism.etp = 2"),
        ({"dp_shard": 2, "tp": 4, "ep": 2}, 8, "parallelism.ep = 2 must be a multiple of cp \\* tp = 4"),
        ({"dp_shard": 2, "ep": 2, "expert_capacity_factor": -1.0}, 2, "expert_capacity_factor = -1.0"),
    ],
)
def test_bad_expert_parallel_layouts_fail_before_any_collective(parallelism, world, message):
    config = build_config({"model": {"name": "deepseek_v3"}, "parallelism": parallelism, "training": {"seq_len": 64}})
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=world)


@pytest.mark.parametrize(
    "parallelism, message",
    [
        ({"dp_shard": 1, "tp": 2, "ep": 2}, "dropless expert parallel reads its split sizes on the host"),
        ({"dp_shard": 2, "ep": 2, "expert_capacity_factor": 8.0}, "FSDP / HSDP free and re-allocate"),
        ({"dp_shard": 1, "tp": 2, "ep": 2, "expert_capacity_factor": 8.0}, None),  # static, unsharded: accepted
    ],
)
def test_cuda_graph_mode_accepts_only_what_a_graph_can_replay(parallelism, message):
    training = {"seq_len": 64, "compile": True, "compile_mode": "reduce-overhead"}
    config = build_config({"model": {"name": "deepseek_v3"}, "parallelism": parallelism, "training": training})
    if message is None:
        assert validate(config, world_size=2).dims.ep == 2
        return
    with pytest.raises(ConfigError, match=message):
        validate(config, world_size=2)


def test_shipped_deepseek_v3_16b_config_validates_with_expert_parallel():
    import dataclasses

    from plait.trainer.config import load_toml

    config = build_config(load_toml("deepseek_v3_16B.toml"))
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, tokenizer_path=""))
    plan = validate(config, world_size=64)  # 8 nodes x 8 GPUs: ep 8 borrowed from dp_shard 64, efsdp 8
    assert plan.dims.ep == 8 and plan.dims.efsdp == 8


def _resume(saved: Path, step: int, dump: Path, ranks: int, batch: int, *extra: str) -> list[float]:
    """Resume `saved`'s step-`step` checkpoint in `dump` on another layout; the resumed losses."""
    name = f"step-{step:06d}"
    shutil.copytree(saved / "checkpoints" / name, dump / "checkpoints" / name)
    run_cli(dump, *COMMON, *SAVES, "--training.local_batch_size", str(batch), "--nproc-per-node", str(ranks),
            *extra, timeout=300)
    return losses(dump)


def _hf_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_checkpoints_reshard_across_expert_parallel_degrees_and_export_every_expert(tmp_path):
    """EP 4 saves; 1 rank resumes it (fewer shards) and EP 2 resumes that (more): every resumed step
    matches the uninterrupted 1-rank run. The HF export of the EP 4 run holds every expert of every
    MoE layer, equal to the 1-rank run's."""
    one_rank_dump = tmp_path / "one"
    run_cli(one_rank_dump, *COMMON, *SAVES, "--training.local_batch_size", "4")
    expected = losses(one_rank_dump)
    ep4 = tmp_path / "ep4"
    run_cli(ep4, *COMMON, *SAVES, "--training.local_batch_size", "1", "--nproc-per-node", "4",
            "--parallelism.ep", "4", timeout=300)
    assert losses(ep4) == pytest.approx(expected, abs=1e-5, rel=0)
    assert _resume(ep4, 2, tmp_path / "ep1", 1, 4) == pytest.approx(expected[2:], abs=1e-5)
    assert _resume(tmp_path / "ep1", 3, tmp_path / "ep2", 2, 2, "--parallelism.ep", "2") == pytest.approx(
        expected[3:], abs=1e-5
    )

    exported = _hf_tensors(next((ep4 / "checkpoints").glob("hf-step-*")))
    reference = _hf_tensors(next((one_rank_dump / "checkpoints").glob("hf-step-*")))
    experts = [k for k in reference if ".mlp.experts." in k]
    assert len(experts) == SAVED_MOE_LAYERS * 8 * 3  # gate, up and down projection of each of 8 experts
    assert sorted(exported) == sorted(reference)
    for key in experts:
        assert torch.allclose(exported[key], reference[key], atol=1e-5), key


def _bias_after_training(rank, world_size, dump, argv):
    from plait.trainer.cli import parse_args
    from plait.trainer.config import build_config, load_toml
    from plait.trainer.train import Trainer

    args = parse_args(["--job.dump_folder", dump, *argv])
    trainer = Trainer(build_config(load_toml(args.config or "deepseek_v3_debugmodel.toml"), args.overrides))
    trainer.train()
    return {k: v.clone() for k, v in trainer.pm.inner.named_buffers() if k.endswith("expert_bias")}


def test_expert_bias_is_bit_identical_on_every_rank(tmp_path):
    """Aux-loss-free balancing under FSDP 2 x TP 2 x EP 2 (etp 1) with accumulation: the counts
    are summed over the ranks that routed different tokens, so all 4 ranks move every bias alike."""
    from plait.testing import run_on_ranks

    argv = [*COMMON, "--training.local_batch_size", "1", "--training.gradient_accumulation_steps", "2",
            "--parallelism.tp", "2", "--parallelism.ep", "2", "--model.load_balance_coeff", "0.01"]
    biases = run_on_ranks(_bias_after_training, 4, str(tmp_path), argv, timeout=240)
    assert len(biases[0]) == MOE_LAYERS
    assert any(b.abs().sum() > 0 for b in biases[0].values())  # balancing moved them
    for other in biases[1:]:
        for key, bias in biases[0].items():
            assert torch.equal(other[key], bias), key


def test_sequence_wise_aux_loss_is_exact_under_context_tensor_and_expert_parallel(tmp_path):
    """The sequence-wise balance loss under CP 2 x TP 2 x EP 4 with selective AC: the expert-choice
    counts of each sequence are summed over its cp ranks in each MoE layer's forward (a functional
    all-reduce, which selective AC saves rather than repeats), each TP rank weighs it 1/tp, and the
    gradient (the norm includes the aux term's) and losses match one rank."""
    aux = ["--model.aux_loss_coeff", "0.1"]
    run_cli(tmp_path / "one", *COMMON, *aux, "--training.local_batch_size", "4")
    run_cli(tmp_path / "many", *COMMON, *aux, "--training.local_batch_size", "4", "--nproc-per-node", "4",
            "--parallelism.dp_shard", "1", "--parallelism.cp", "2", "--parallelism.tp", "2", "--parallelism.ep", "4",
            "--parallelism.cp_method", "ring", "--training.activation_checkpoint", "selective", timeout=300)
    one, many = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "many")
    assert [r["loss"] for r in many] == pytest.approx([r["loss"] for r in one], abs=1e-5, rel=0)
    assert [r["grad_norm"] for r in many] == pytest.approx([r["grad_norm"] for r in one], rel=1e-4)
