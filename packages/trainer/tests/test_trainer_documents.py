"""Document masking through plait-train (issue 22): the loader's document positions reach attention,
the keys are checked, and documents past the RoPE tables are refused before they are trained on."""

import json

import pytest
import torch

from plait.data.pretokenize import main as pretokenize_main
from plait.testing.trainer import parity_args, train_in_process
from plait.trainer.cli import main
from plait.trainer.config import ConfigError, build_config
from plait.trainer.step import StepRunner
from plait.trainer.validate import validate

DOCS = ["--model.attention_mask", "document", "--model.rope_positions", "document"]
SMALL = [*parity_args(steps=2, seq_len=64), "--metrics.log_freq", "1", "--metrics.tensorboard", "false",
         "--model.n_layers", "1", "--training.local_batch_size", "4"]  # fmt: skip


def test_document_mask_reaches_attention_and_changes_the_loss(tmp_path, monkeypatch):
    """The step's model calls get the loader's document positions (whole rows), and the loss moves
    off causal's: short documents, several per 64-token row."""
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": f"Note {i}: now is better than never. " * (1 + i % 3)}) + "\n"
                            for i in range(200)))
    data = ["--data.dataset", "json", "--data.dataset_path", str(path), "--data.val_dataset", ""]
    seen = []
    forward = StepRunner.forward

    def recording(self, tokens_BS, positions, documents_BS, mtp=None, labels_BS=None):
        seen.append(documents_BS)
        return forward(self, tokens_BS, positions, documents_BS, mtp, labels_BS)

    monkeypatch.setattr(StepRunner, "forward", recording)
    causal = train_in_process(tmp_path / "causal", *SMALL, *data)
    assert seen == [None, None]
    seen.clear()
    documents = train_in_process(tmp_path / "document", *SMALL, *DOCS, *data)
    assert len(seen) == 2 and all(d is not None and d.shape == (4, 64) and d.dtype == torch.int32 for d in seen)
    assert any(len(d._plait_document_segments[b]) > 2 for d in seen for b in range(4))  # rows with boundaries
    assert abs(documents[0]["loss"] - causal[0]["loss"]) > 1e-4


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model.rope_positions", "document"], "needs model.attention_mask = 'document'"),
        (["--model.attention_mask", "block"], "model.attention_mask = 'block'"),
        (["--model.rope_positions", "doc", "--model.attention_mask", "document"], "model.rope_positions = 'doc'"),
    ],
)
def test_bad_mask_settings_fail_with_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.strip().count("\n") == 0, err


def test_documents_past_the_rope_tables_are_refused(tmp_path, capsys):
    """A pre-tokenised folder knows its longest document: refused before anything runs. Other
    sources: at the first batch that holds one, before it is trained on (exit 2, one line)."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": "Now is better than never. " * n}) + "\n" for n in (3, 40, 5)))
    folder = tmp_path / "tokens"
    assert pretokenize_main(["--dataset", "json", "--dataset-path", str(path), "--output", str(folder)]) == 0
    args = [*SMALL, *DOCS, "--data.dataset", "tokens", "--data.dataset_path", str(folder), "--model.max_seq_len", "64"]
    config = build_config({}, _overrides(args))
    with pytest.raises(ConfigError, match="model.rope_positions = 'document': .* holds a document of"):
        validate(config, world_size=1)

    builtin = [*SMALL, *DOCS, "--model.max_seq_len", "64", "--job.dump_folder", str(tmp_path / "run"),
               "--data.val_dataset", ""]
    assert main(builtin) == 2
    err = capsys.readouterr().err
    assert "model.rope_positions = 'document': a document reaches" in err, err


def _overrides(args: list[str]) -> dict:
    from plait.trainer.cli import parse_args

    return parse_args(args).overrides



def test_validation_runs_document_masked(tmp_path, monkeypatch):
    """The validation loss goes through the same masked forward (documents reach attention)."""
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": f"Note {i}: now is better than never. " * (1 + i % 3)}) + "\n"
                            for i in range(100)))
    seen = []
    forward = StepRunner.forward

    def recording(self, tokens_BS, positions, documents_BS, mtp=None, labels_BS=None):
        seen.append((torch.is_grad_enabled(), documents_BS is not None))
        return forward(self, tokens_BS, positions, documents_BS, mtp, labels_BS)

    monkeypatch.setattr(StepRunner, "forward", recording)
    train_in_process(tmp_path / "val", *SMALL, *DOCS, "--data.dataset", "json", "--data.dataset_path", str(path),
                     "--data.val_dataset", "json", "--data.val_interval", "2", "--data.val_steps", "1")
    assert (False, True) in seen  # a no-grad (validation) forward with document positions
    assert all(documents for _, documents in seen)
