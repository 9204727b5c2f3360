"""training.loss = chunked in plait-train's step, one process: the same loss and gradients as
training.loss = full (Llama 3; DeepSeek-V3 with an MTP depth and document masking, whose one head
call covers the main row and the depth), the state dict's names unchanged, the validation loss
equal, and the configuration checks."""

import pytest
import torch

from plait.trainer.config import ConfigError, build_config, load_toml
from plait.trainer.loss_head import LossHead
from plait.trainer.train import Trainer

SEQ = 32


def _trainer(dump, model="llama3", loss="full", dtype="float32", model_args=None, data=None, **training):
    overrides = {
        "job": {"dump_folder": str(dump)},
        "data": data or {},
        "model": {"n_layers": 2, **(model_args or {})},
        "training": {"steps": 1, "seq_len": SEQ, "local_batch_size": 4, "dtype": dtype, "deterministic": True,
                     "loss": loss, "loss_chunk_tokens": 24, **training},  # fmt: skip
        "metrics": {"cpu_peak_tflops": 0.1},
    }
    toml = load_toml(f"{model}_debugmodel.toml")
    for section, values in overrides.items():
        toml[section] = {**toml.get(section, {}), **values}
    trainer = Trainer(build_config(toml))
    trainer.grads = {}
    trainer.optimizer.register_step_pre_hook(
        lambda *_: trainer.grads.update({n: p.grad.clone() for n, p in trainer.pm.inner.named_parameters()})
    )
    return trainer


def _batch(vocab=2048, documents=False):
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (4, SEQ + 1), generator=g)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :10] = -100
    labels[3, :] = -100  # a whole row (and whole chunks of 24 tokens) ignored
    if not documents:
        return (inputs, labels)
    positions = torch.cat([torch.arange(13), torch.arange(SEQ - 13)]).repeat(4, 1).to(torch.int32)
    return (inputs, labels, positions)


def _compare(full, chunked, batch, loss_tol=1e-6, grad_rtol=1e-5):
    loss_full, norm_full = full.train_step([batch])
    loss_chunked, norm_chunked = chunked.train_step([batch])
    torch.testing.assert_close(loss_chunked, loss_full, atol=loss_tol, rtol=loss_tol)
    torch.testing.assert_close(norm_chunked, norm_full, atol=0, rtol=grad_rtol)
    assert set(full.grads) == set(chunked.grads)
    for name, grad in full.grads.items():
        diff = ((chunked.grads[name] - grad).norm() / grad.norm().clamp(min=1e-30)).item()
        assert diff < grad_rtol, (name, diff)


def test_llama3_chunked_matches_full(tmp_path):
    full, chunked = _trainer(tmp_path / "full"), _trainer(tmp_path / "chunked", loss="chunked")
    assert isinstance(chunked.pm.inner.output, LossHead) and not isinstance(full.pm.inner.output, LossHead)
    assert chunked.pm.inner.state_dict().keys() == full.pm.inner.state_dict().keys()  # output.weight kept
    _compare(full, chunked, _batch())


@pytest.mark.timeout(300)
def test_deepseek_mtp_documents_chunked_matches_full(tmp_path):
    """One head call over the main row and the depth ([2B, S]), each loss with its own scale."""
    args = {"mtp_layers": 1, "attention_mask": "document", "rope_positions": "document"}
    full = _trainer(tmp_path / "full", "deepseek_v3", model_args=args)
    chunked = _trainer(tmp_path / "chunked", "deepseek_v3", "chunked", model_args=args)
    _compare(full, chunked, _batch(documents=True))


def test_bf16_one_rank_chunked_matches_full(tmp_path):
    """Autocast: the head's product in bf16 (the CPU's fp32-kernel route), the softmax in fp32."""
    full = _trainer(tmp_path / "full", dtype="bfloat16", cpu_bf16="fp32")
    chunked = _trainer(tmp_path / "chunked", "llama3", "chunked", dtype="bfloat16", cpu_bf16="fp32")
    _compare(full, chunked, _batch(), loss_tol=1e-3, grad_rtol=2e-2)


def test_validation_loss_is_the_same(tmp_path):
    full, chunked = _trainer(tmp_path / "full"), _trainer(tmp_path / "chunked", loss="chunked")
    inputs, labels = _batch()
    with torch.no_grad():
        expected = full.runner.loss_fn(full.runner.forward(inputs, None, None), labels)
        out = chunked.runner.forward(inputs, None, None, labels_BS=labels)
        got = chunked.runner.loss_fn(out, labels)
    assert out.shape == labels.shape  # per-token losses, not logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-6)


def test_validation_loop_is_the_same(tmp_path):
    """Trainer.validate_loss over the built-in validation split: the head takes each batch's labels."""
    data = {"val_dataset": "builtin", "val_steps": 2}
    full = _trainer(tmp_path / "full", data=data)
    chunked = _trainer(tmp_path / "chunked", loss="chunked", data=data)
    assert chunked.validate_loss() == pytest.approx(full.validate_loss(), abs=1e-5)


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="training.loss_chunk_tokens = -1"):
        _trainer(tmp_path / "neg", loss="chunked", loss_chunk_tokens=-1)
    with pytest.raises(ConfigError, match="training.loss"):
        build_config({"training": {"loss": "fused"}})


@pytest.mark.timeout(600)
def test_compiled_chunked_matches_full(tmp_path):
    """training.compile: the head's chunked loss is compiled whole (fullgraph: a graph break raises)."""
    from plait.trainer.chunked_loss import chunked_linear_cross_entropy

    # One block (compile time); the reference eager: what is compared is the compiled head's loss.
    full = _trainer(tmp_path / "full", model_args={"n_layers": 1})
    chunked = _trainer(tmp_path / "chunked", loss="chunked", model_args={"n_layers": 1}, compile=True)
    assert chunked.pm.inner.output.loss is not chunked_linear_cross_entropy  # the compiled one
    _compare(full, chunked, _batch(), loss_tol=1e-5, grad_rtol=1e-4)
