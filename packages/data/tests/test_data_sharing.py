"""Ranks share the tokenising: each rank encodes ~1/R of the documents and receives only its rows,
yet the global batches are the one-rank loader's, for dp 1, 2, 4 and after resume (in-process
ranks as threads; the gloo exchange itself is covered by test_trainer_data_distributed.py)."""

import json
import threading

import pytest
import torch

from plait.data import build_dataloader, build_tokenizer
from plait.data.exchange import ThreadExchange

SEQ, GLOBAL, STEPS = 32, 8, 6


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("sharing") / "train.jsonl"
    docs = [f"Document {i}: " + "Flat is better than nested. " * (1 + (i * 7) % 13) for i in range(120)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def on_threads(degree, fn):
    """fn(rank, exchange) on `degree` threaded ranks; results in rank order."""
    exchanges, results, errors = ThreadExchange.group(degree), [None] * degree, []

    def run(rank):
        try:
            results[rank] = fn(rank, exchanges[rank])
        except BaseException as e:  # surface a rank's failure in the test
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(degree)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def make(tok, corpus, rank, degree, exchange=None, accum=1):
    return build_dataloader("json", corpus, tok, SEQ, GLOBAL // degree // accum, accum, rank, degree, 0,
                            exchange=exchange)


def steps(ld, n):
    """n steps of one rank: [n, rows, 2 * SEQ], each row's inputs then its document positions (so
    every comparison covers both)."""
    return torch.stack([torch.cat([torch.cat([x, p.long()], dim=1) for x, _, p in ld.__next__()])
                        for _ in range(n)])


def test_ranks_encode_their_share_and_see_the_one_rank_batches(tok, corpus):
    solo = make(tok, corpus, 0, 1)
    reference = steps(solo, STEPS)  # [STEPS, GLOBAL, SEQ]
    for degree, accum in [(1, 1), (2, 1), (4, 1), (2, 2)]:
        def run(rank, ex, degree=degree, accum=accum):
            ld = make(tok, corpus, rank, degree, ex, accum)
            return steps(ld, STEPS), ld.encoded_documents, ld.state_dict()

        runs = on_threads(degree, run)
        assert torch.equal(torch.cat([x for x, _, _ in runs], dim=1), reference), (degree, accum)
        counts = [n for _, n, _ in runs]
        # The same documents are resolved whatever the degree; each rank tokenised its 1/R of them.
        assert sum(counts) == solo.encoded_documents and max(counts) - min(counts) <= 1, counts
        assert all(state == solo.state_dict() for _, _, state in runs)


def test_resume_under_other_degrees(tok, corpus):
    def first_half(rank, ex):
        ld = make(tok, corpus, rank, 2, ex)
        steps(ld, 3)
        return json.loads(json.dumps(ld.state_dict())), steps(ld, 3)

    (state, a), (_, b) = on_threads(2, first_half)
    expected = torch.cat([a, b], dim=1)
    for degree in (1, 4):
        def resumed(rank, ex, degree=degree):
            ld = make(tok, corpus, rank, degree, ex)
            ld.load_state_dict(state)
            return steps(ld, 3)

        assert torch.equal(torch.cat(on_threads(degree, resumed), dim=1), expected), degree


def test_streaming_split_by_node(tok, tmp_path):
    # One file is one shard, so split_dataset_by_node gives rank r every R-th example: the global
    # order is the unsplit stream's, across epochs too (60 documents, R divides it).
    path = tmp_path / "stream.jsonl"
    path.write_text("".join(json.dumps({"text": f"Streamed {i}. " + "Simple is better than complex. " * (1 + i % 6)})
                            + "\n" for i in range(60)))

    def stream(rank, degree, ex=None):
        return build_dataloader("json", str(path), tok, SEQ, GLOBAL // degree, 1, rank, degree, 0,
                                streaming=True, exchange=ex)

    solo = stream(0, 1)
    reference = steps(solo, 14)  # past the end of the 60 documents
    assert solo.state_dict()["epoch"] >= 1
    for degree in (2, 3 if GLOBAL % 3 == 0 else 4):
        def run(rank, ex, degree=degree):
            ld = stream(rank, degree, ex)
            first = steps(ld, 6)
            state = json.loads(json.dumps(ld.state_dict()))
            rest = steps(ld, 8)
            again = stream(rank, degree, ex)  # a resumed run on the same number of ranks
            again.load_state_dict(state)
            return first, rest, steps(again, 8), ld.documents.documents_read, state

        runs = on_threads(degree, run)
        assert torch.equal(torch.cat([torch.cat([a, b]) for a, b, _, _, _ in runs], dim=1), reference), degree
        assert torch.equal(torch.cat([c for _, _, c, _, _ in runs], dim=1), reference[6:]), degree
        reads = [n for _, _, _, n, _ in runs]
        assert max(reads) <= solo.documents.documents_read // degree + 3, reads  # each reads its part
        state = runs[0][4]
        with pytest.raises(ValueError, match="same number of ranks"):
            on_threads(1, lambda r, ex, state=state: stream(0, 1, ex).load_state_dict(state))
