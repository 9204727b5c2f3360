"""Document masking on one process: a packed row equals each document run alone, every model."""

import dataclasses

import pytest
import torch

from plait.models import deepseek_v3, llama3, qwen3
from plait.models.documents import row_segments

# One row packs: the tail of a document (starts mid-document at offset 5), a 1-token document,
# a 16-token one, one of 30 tokens and a last of 12. The other row is one document.
LENGTHS = (5, 1, 16, 30, 12)
SEQ = sum(LENGTHS)


def _document_positions(lengths, first_offset=0):
    pieces = [torch.arange(n) for n in lengths]
    pieces[0] = pieces[0] + first_offset
    return torch.cat(pieces).int()


def _llama(**overrides):
    args = llama3.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=128, max_seq_len=128,
                            multiple_of=32, **overrides)
    return llama3.Transformer, args


def _deepseek(**overrides):
    small = dict(vocab_size=128, dim=64, inter_dim=128, moe_inter_dim=32, n_layers=2, n_heads=4,
                 kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, max_seq_len=128,
                 original_seq_len=32, **overrides)
    return deepseek_v3.Transformer, dataclasses.replace(deepseek_v3.FLAVORS["debugmodel"], **small)


def _qwen3(**overrides):
    small = dict(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, inter_dim=96, max_seq_len=128)
    return qwen3.Transformer, dataclasses.replace(qwen3.FLAVORS["debugmodel"], **small, **overrides)


def _qwen3_moe(**overrides):
    # No sequence-wise aux loss: it trains inside the blocks' backward (the router's tie), and its
    # sequences differ between a packed row and its documents run alone (its own test:
    # test_moe_aux_loss.py).
    return _qwen3(n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, aux_loss_coeff=0.0, **overrides)


def _build(family, seed=0, **overrides):
    cls, args = family(**overrides)
    torch.manual_seed(seed)
    model = cls(args)
    model.init_weights()
    return model


def test_row_segments_cut_at_zeros_and_row_start():
    positions = torch.stack([_document_positions(LENGTHS, first_offset=5), torch.arange(SEQ).int()])
    segments = row_segments(positions)
    assert segments == ((0, 5, 6, 22, 52, SEQ), (0, SEQ))
    assert row_segments(positions) is segments  # read once, cached on the tensor


@pytest.mark.parametrize("rope", ["document", "sequence"])
@pytest.mark.parametrize("family", [_llama, _deepseek, _qwen3, _qwen3_moe],
                         ids=["llama3", "deepseek_v3", "qwen3", "qwen3_moe"])
def test_packed_row_equals_each_document_alone(family, rope):
    """Every token's logits and the summed loss's gradients equal running each document alone."""
    packed = _build(family, attention_mask="document", rope_positions=rope)
    alone = _build(family)  # plain causal, same weights (same seed)
    alone.load_state_dict(packed.state_dict())
    torch.manual_seed(1)
    tokens_BS = torch.randint(0, 128, (2, SEQ))
    doc_BS = torch.stack([_document_positions(LENGTHS, first_offset=5), torch.arange(SEQ).int()])

    logits = packed(tokens_BS, document_positions=doc_BS)
    logits.float().logsumexp(-1).sum().backward()

    starts = (0, *torch.tensor(LENGTHS).cumsum(0).tolist())
    expected = []
    for s, e in zip(starts, starts[1:]):
        # RoPE positions as the packed run used them: per document, or the sequence index.
        positions = doc_BS[0, s:e].long() if rope == "document" else torch.arange(s, e)
        expected.append(alone(tokens_BS[:1, s:e], positions))
    expected_row1 = alone(tokens_BS[1:], torch.arange(SEQ))
    expected_logits = torch.cat([torch.cat(expected, dim=1), expected_row1])
    expected_logits.float().logsumexp(-1).sum().backward()

    torch.testing.assert_close(logits, expected_logits, atol=2e-5, rtol=1e-5)
    grads = dict(alone.named_parameters())
    for name, p in packed.named_parameters():
        if p.grad is None:
            assert grads[name].grad is None, name
            continue
        torch.testing.assert_close(p.grad, grads[name].grad, atol=2e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", [_llama, _deepseek], ids=["llama3", "deepseek_v3"])
def test_document_mask_needs_document_positions(family):
    model = _build(family, attention_mask="document")
    with pytest.raises(ValueError, match="document_positions"):
        model(torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="attention_mask"):
        family(attention_mask="documents")


def test_one_document_per_row_is_causal():
    packed, causal = _build(_llama, attention_mask="document"), _build(_llama)
    tokens_BS = torch.randint(0, 128, (2, 32))
    doc_BS = torch.arange(32).int().expand(2, 32)
    torch.testing.assert_close(packed(tokens_BS, document_positions=doc_BS), causal(tokens_BS), atol=0, rtol=0)
