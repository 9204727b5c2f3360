"""The data exchange over real gloo ranks: 2 ranks tokenise half the documents each and get the
one-rank loader's batches (one spawn for all checks)."""

import json

import torch

from plait.testing import run_on_ranks

SEQ, GLOBAL, STEPS = 32, 8, 4


def _corpus(folder):
    path = f"{folder}/train.jsonl"
    with open(path, "w") as f:
        for i in range(80):
            f.write(json.dumps({"text": f"Doc {i} " + "Errors should never pass silently. " * (1 + i % 9)}) + "\n")
    return path


def _steps(ld, n):
    """[n, rows, 2 * SEQ]: each row's inputs, then its document positions (compared together)."""
    return torch.stack([torch.cat([torch.cat([x, p.long()], dim=1) for x, _, p in next(ld)]) for _ in range(n)])


def _rank(rank, world, path):
    import torch.distributed as dist

    from plait.data import build_dataloader, build_tokenizer
    from plait.data.exchange import DistributedExchange

    tok = build_tokenizer(None)
    exchange = DistributedExchange(dist.new_group(backend="gloo"))
    ld = build_dataloader("json", path, tok, SEQ, GLOBAL // world, 1, rank, world, 0, exchange=exchange)
    mine, encoded = _steps(ld, STEPS), ld.encoded_documents
    state = ld.state_dict()
    ld.load_state_dict(json.loads(json.dumps(state)))  # resume: the next steps continue exactly
    return mine, _steps(ld, 2), encoded, state


def test_two_gloo_ranks_share_tokenising(tmp_path):
    from plait.data import build_dataloader, build_tokenizer

    path = _corpus(tmp_path)
    solo = build_dataloader("json", path, build_tokenizer(None), SEQ, GLOBAL, 1, 0, 1, 0)
    reference = _steps(solo, STEPS)
    solo_encoded = solo.encoded_documents
    reference = torch.cat([reference, _steps(solo, 2)])
    results = run_on_ranks(_rank, 2, path, timeout=120)
    got = torch.cat([torch.cat([a, b]) for a, b, _, _ in results], dim=1)
    assert torch.equal(got, reference)
    counts = [n for _, _, n, _ in results]
    assert sum(counts) == solo_encoded and abs(counts[0] - counts[1]) <= 1, counts
    assert results[0][3] == results[1][3]
