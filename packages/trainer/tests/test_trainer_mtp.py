"""Multi-token prediction (model.mtp_layers, issue 43): each depth's shifted tokens and targets, no
prediction across a document's end (a packed row's MTP losses are each document's alone), one-line
refusals, and a DeepSeek-V3 run that logs the main loss and each depth's. The layouts (FSDP, TP + SP
+ loss parallel, CP 2 by each method, EP, PP 1F1B / Interleaved1F1B, documents under CP, FSDP x CP
x TP x EP) are in the parity matrix (tests/)."""

import argparse
import json
import math

import pytest
import torch
import torch.nn.functional as F

from plait.testing.trainer import losses, read_metrics, run_cli
from plait.trainer.config import ConfigError, build_config
from plait.trainer.mtp import IGNORE_INDEX, shifted_rows
from plait.trainer.validate import validate


def _config(*pairs):
    return build_config(None, list(zip(pairs[::2], pairs[1::2])))


def test_depth_k_reads_the_token_k_ahead_and_predicts_the_next_one():
    inputs_BS = torch.arange(10, 18)[None]  # tokens t_0 .. t_7; labels t_1 .. t_8
    labels_BS = inputs_BS + 1
    tokens_KBS, targets_KBS = shifted_rows(inputs_BS, labels_BS, depths=2)
    for k in (1, 2):
        assert tokens_KBS[k - 1, 0, : 8 - k].tolist() == list(range(10 + k, 18))
        assert targets_KBS[k - 1, 0].tolist() == list(range(11 + k, 19)) + [IGNORE_INDEX] * k
    # Document positions: two documents of 5 and 3 tokens. A target counts only while the token
    # depth k reads is in position i's document.
    positions_BS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]])
    _, targets_KBS = shifted_rows(inputs_BS, labels_BS, depths=2, document_positions_BS=positions_BS)
    assert targets_KBS[0, 0].tolist() == [12, 13, 14, 15, -100, 17, 18, -100]
    assert targets_KBS[1, 0].tolist() == [13, 14, 15, -100, -100, 18, -100, -100]


def _mtp_loss_sums(model, inputs_BS, labels_BS, positions_BS):
    """(main loss sum, [each depth's loss sum]) of rows whose documents the positions mark."""
    tokens_KBS, targets_KBS = shifted_rows(inputs_BS, labels_BS, 2, positions_BS)
    logits_BSV, *depth_logits = model(inputs_BS, None, positions_BS, mtp_tokens=tokens_KBS.transpose(0, 1))
    ce = lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")  # noqa: E731
    return ce(logits_BSV, labels_BS), [ce(logits, targets_KBS[k]) for k, logits in enumerate(depth_logits)]


def test_a_packed_rows_mtp_losses_are_each_documents_alone():
    """Under document masking (attention and RoPE per document) a packed row's main and MTP losses
    are the sums of its documents' run alone: no depth predicts across a document's end."""
    from plait.models.deepseek_v3 import ModelArgs, Transformer

    args = ModelArgs(vocab_size=64, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_heads=4, kv_lora_rank=32,
                     qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, max_seq_len=64, mtp_layers=2,
                     attention_mask="document", rope_positions="document")  # fmt: skip
    torch.manual_seed(0)
    model = Transformer(args)
    model.init_weights()
    stream = torch.randint(0, 64, (1, 25))  # documents of 9, 11 and 4 tokens, then the next token
    lengths = [9, 11, 4]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    packed = _mtp_loss_sums(model, stream[:, :-1], stream[:, 1:], positions)
    alone_main, alone_depths, start = 0.0, [0.0, 0.0], 0
    for n in lengths:
        row = stream[:, start : start + n + 1]
        main, depths = _mtp_loss_sums(model, row[:, :-1], row[:, 1:], torch.arange(n)[None])
        alone_main += main
        alone_depths = [a + d for a, d in zip(alone_depths, depths)]
        start += n
    torch.testing.assert_close(packed[0], alone_main, atol=1e-4, rtol=1e-5)
    for depth, alone in zip(packed[1], alone_depths):
        torch.testing.assert_close(depth, alone, atol=1e-4, rtol=1e-5)


def test_bad_mtp_settings_are_one_line():
    refusals = {
        r"model.mtp_layers = -1 \(deepseek_v3 debugmodel\): must be >= 0":
            ("model.name", "deepseek_v3", "model.mtp_layers", "-1"),
        r"model.mtp_loss_scale = -0.5 \(deepseek_v3 debugmodel\): must be >= 0":
            ("model.name", "deepseek_v3", "model.mtp_loss_scale", "-0.5"),
    }  # fmt: skip
    for message, pairs in refusals.items():
        with pytest.raises(ConfigError, match=message) as info:
            validate(_config(*pairs), world_size=2)
        assert "\n" not in str(info.value)
    # Pipeline parallel: the depths (the last blocks) must be on the last stage (checked without
    # plait-pipelineparallel installed: this package's tests run without it).
    from plait.mesh import ParallelDims
    from plait.trainer.mtp import check_mtp_stages

    config = _config("model.name", "deepseek_v3", "parallelism.pp", "2", "parallelism.layers_per_stage", "2,0")
    with pytest.raises(ConfigError, match=r"parallelism.layers_per_stage = 2,0 puts model.mtp_layers = 1 multi-token-"
                       r"prediction depths .* before the last stage: give the last stage at least 1"):
        check_mtp_stages(config, ParallelDims(world_size=2, pp=2), argparse.Namespace(mtp_layers=1, n_layers=1))
    for pairs, message in (((("model.name", "deepseek_v3", "model.mtp_loss_scale", "nan")), r"model.mtp_loss_scale = 'nan': must be a finite number"),
                           ((("model.name", "llama3", "model.mtp_layers", "1")), r"unknown config key 'model.mtp_layers'")):
        with pytest.raises(ConfigError, match=message):
            validate(_config(*pairs), world_size=1)


def test_deepseek_v3_trains_with_mtp_and_logs_each_depth(tmp_path):
    """One rank, two depths: the metrics hold the main loss and each depth's; validation reports the
    main loss; the run resumes from its checkpoint, and a resume without MTP is refused in one line."""
    dump = tmp_path / "run"
    # Sigmoid routing: the scores HF's DeepseekV3 has (the export below).
    model = ["--model.name", "deepseek_v3", "--model.n_layers", "2", "--model.score_func", "sigmoid"]
    shape = ["--training.seq_len", "32", "--training.local_batch_size", "2", "--metrics.tensorboard", "false"]
    args = [*model, "--model.mtp_layers", "2", *shape, "--metrics.log_freq", "1",
            "--checkpoint.enable", "true", "--checkpoint.interval", "2"]  # fmt: skip
    run_cli(dump, *args, "--training.steps", "2")
    rows = read_metrics(dump)
    assert len(rows) == 2 and all(len(r["mtp_loss"]) == 2 and all(map(math.isfinite, r["mtp_loss"])) for r in rows)
    assert all(r["loss"] != r["mtp_loss"][0] for r in rows)
    resumed = run_cli(dump, *args, "--training.steps", "3", "--checkpoint.last_save_in_hf", "true")
    assert "(step 2, same layout" in resumed.stdout and len(losses(dump)) == 3
    refused = run_cli(dump, *args, "--model.mtp_layers", "0", "--training.steps", "4", expect=None)
    assert refused.returncode != 0 and "mtp_layers 2 (now 0)" in refused.stderr.strip().splitlines()[-1]
    # The Hugging Face export holds the depths in the released naming (the layers after the last
    # block); a run with one depth starts from it, a layer at a time (the second depth is not read).
    hf_dir = next((dump / "checkpoints").glob("hf-step-*"))
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"model.layers.2.eh_proj.weight", "model.layers.3.shared_head.norm.weight"} <= set(index)
    started = run_cli(tmp_path / "from_hf", *model, "--model.mtp_layers", "1", *shape, "--training.steps", "1",
                      "--checkpoint.initial_load_path", str(hf_dir), "--checkpoint.initial_load_hf", "true")
    assert math.isfinite(losses(tmp_path / "from_hf")[0]), started.stdout[-2000:]


def test_validation_reports_the_main_loss(tmp_path):
    """With MTP on, validation runs the model without the shifted rows: its loss is the main head's
    (the depths train, they are not the model's prediction), logged as val_loss."""
    result = run_cli(tmp_path / "val", "--model.name", "deepseek_v3", "--model.n_layers", "2", "--model.mtp_layers",
                     "1", "--training.seq_len", "32", "--training.local_batch_size", "2", "--training.steps", "1",
                     "--data.val_dataset", "builtin", "--data.val_interval", "1", "--data.val_steps", "1",
                     "--metrics.tensorboard", "false")  # fmt: skip
    (line,) = [line for line in result.stdout.splitlines() if "val_loss" in line]
    assert math.isfinite(float(line.split("val_loss")[1])) and "mtp" not in line


def test_two_depths_optimise_main_plus_scale_times_their_mean(tmp_path):
    """Issue 53, item 9: with mtp_layers 2 and gradient accumulation 2 the step's gradient is that
    of main + mtp_loss_scale x mean(depth 1, depth 2), each loss the mean over its own valid targets
    of the whole step, computed here from the model's logits by a short formula of its own (depth k
    at position i reads token i + k and predicts label i + k; the last k positions have none)."""
    import copy

    from plait.trainer.cli import parse_args
    from plait.trainer.config import load_toml
    from plait.trainer.train import Trainer

    args = ["--job.dump_folder", str(tmp_path), "--model.name", "deepseek_v3", "--model.n_layers", "2",
            "--model.mtp_layers", "2", "--model.mtp_loss_scale", "0.3", "--training.steps", "1",
            "--training.seq_len", "32", "--training.local_batch_size", "2",
            "--training.gradient_accumulation_steps", "2", "--training.deterministic", "true",
            "--metrics.log_freq", "1", "--metrics.tensorboard", "false"]  # fmt: skip
    parsed = parse_args(args)
    trainer = Trainer(build_config(load_toml("deepseek_v3_debugmodel.toml"), parsed.overrides))
    model = copy.deepcopy(trainer.pm.inner)  # the initial weights
    seen = {}
    train_step, optimizer_step = trainer.train_step, trainer.optimizer.step

    def keep_batches(micro_batches):
        seen["batches"] = [tuple(t.clone() if isinstance(t, torch.Tensor) else t for t in mb) for mb in micro_batches]
        return train_step(micro_batches)

    def keep_grads(*a, **k):
        seen["grads"] = {n: p.grad.clone() for n, p in trainer.pm.inner.named_parameters() if p.grad is not None}
        return optimizer_step(*a, **k)

    trainer.train_step, trainer.optimizer.step = keep_batches, keep_grads
    try:
        trainer.train()
    finally:
        trainer.release(0)
    sums, counts = [0.0, 0.0, 0.0], [0, 0, 0]
    for inputs_BS, labels_BS, *_ in seen["batches"]:
        S = inputs_BS.shape[1]
        reads = torch.stack([inputs_BS.roll(-k, 1) for k in (1, 2)], 1)  # [B, K, S]
        logits = model(inputs_BS, None, None, mtp_tokens=reads)
        for k, logits_BSV in enumerate(logits):
            targets = labels_BS.clone()
            if k:
                targets = torch.cat([labels_BS[:, k:], torch.full_like(labels_BS[:, :k], -100)], 1)
            sums[k] = sums[k] + F.cross_entropy(logits_BSV.flatten(0, 1), targets.flatten(), reduction="sum",
                                                ignore_index=-100)  # fmt: skip
            counts[k] += int((targets != -100).sum())
        assert S == 32
    main, depth1, depth2 = (s / c for s, c in zip(sums, counts))
    assert counts == [2 * 2 * 32, 2 * 2 * 31, 2 * 2 * 30]
    (main + 0.3 * (depth1 + depth2) / 2).backward()
    for name, param in model.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(seen["grads"][name], param.grad, rtol=1e-4, atol=1e-6, msg=name)
    row = read_metrics(tmp_path)[0]
    assert row["loss"] == pytest.approx(main.item(), rel=1e-5)
    assert row["mtp_loss"] == pytest.approx([depth1.item(), depth2.item()], rel=1e-5)
