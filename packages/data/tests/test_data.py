"""Tokenizer and packed data loader: round trips, specials, layouts, resume, local formats."""

import base64
import json

import pytest
import torch

from plait.data import build_dataloader, build_tokenizer
from plait.data.tokenizer import LLAMA3_SPECIAL_TOKENS, Tokenizer

SEQ = 32


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


def loader(tok, batch, accum, rank, degree, seed=0, dataset="builtin", path=None, **kw):
    return build_dataloader(dataset, path, tok, SEQ, batch, accum, rank, degree, seed, **kw)


def global_batch(loaders):
    """One step of every rank, concatenated in rank order -> [G, SEQ] inputs, labels and
    document positions."""
    steps = [next(ld) for ld in loaders]
    return tuple(torch.cat([mb[k] for step in steps for mb in step]) for k in range(3))


# ---- tokenizer ----

def test_shipped_tokenizer_fits_debug_vocab(tok):
    assert tok.n_words <= 2048
    assert tok.n_words == tok.num_base_tokens + 256
    assert tok.bos_id == tok.num_base_tokens and tok.eos_id == tok.bos_id + 1
    assert build_tokenizer("").n_words == tok.n_words


def test_round_trip_and_specials(tok):
    text = "def f(x):\n    return x ** 2  # héllo wörld, 🙂 \t\n\nThe Zen of Python."
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert all(0 <= i < tok.n_words for i in ids)
    assert tok.decode(ids[1:-1]) == text
    assert tok.encode(text, bos=False, eos=False) == ids[1:-1]
    # Special-token text in data is plain text, unless asked for.
    plain = tok.encode("<|begin_of_text|>", bos=False, eos=False)
    assert tok.bos_id not in plain and tok.decode(plain) == "<|begin_of_text|>"
    assert tok.encode("<|eot_id|>", bos=False, eos=False, allow_special=True) == [tok.special_tokens["<|eot_id|>"]]
    assert tok.decode([tok.bos_id, tok.eos_id]) == "<|begin_of_text|><|end_of_text|>"
    # Very long runs are cut before tiktoken's regex sees them; the text still round-trips.
    long = "x" * 60_000 + " " * 30_000 + "word " * 1000
    assert tok.decode(tok.encode(long, bos=False, eos=False)) == long
    # BPE compresses English: well under one token per character.
    sample = "Return a new list containing all items from the iterable in ascending order."
    assert len(tok.encode(sample, False, False)) < len(sample) / 2.5


def test_real_format_file(tmp_path):
    # A tiny Llama 3 style tokenizer.model: the 256 bytes, then a few merges.
    ranks = [bytes([b]) for b in range(256)] + [b"he", b"ll", b"hell", b"hello", b" w"]
    path = tmp_path / "tokenizer.model"
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(ranks)))
    t = build_tokenizer(str(path))
    assert isinstance(t, Tokenizer)
    assert t.n_words == len(ranks) + 256
    assert t.bos_id == len(ranks) and t.eos_id == len(ranks) + 1
    assert t.special_tokens[LLAMA3_SPECIAL_TOKENS[-1]] == t.n_words - 1
    ids = t.encode("hello world", bos=True, eos=False)
    assert ids[:2] == [t.bos_id, ranks.index(b"hello")]
    assert t.decode(ids[1:]) == "hello world"


def test_missing_and_malformed_files(tmp_path):
    missing = tmp_path / "nope" / "tokenizer.model"
    with pytest.raises(FileNotFoundError, match="nope"):
        build_tokenizer(str(missing))
    bad = tmp_path / "bad.model"
    bad.write_text("aGk= 0\n")  # no single-byte ranks
    with pytest.raises(ValueError, match="single bytes"):
        build_tokenizer(str(bad))


# ---- loader ----

def test_shapes_and_shifted_labels(tok, tmp_path):
    path = tmp_path / "short.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    ld = loader(tok, batch=3, accum=2, rank=0, degree=1, dataset="json", path=str(path))
    step = next(ld)
    assert len(step) == 2
    for x, y, p in step:
        assert x.shape == y.shape == p.shape == (3, SEQ)
        assert x.dtype == y.dtype == torch.int64 and p.dtype == torch.int32
        assert x.device.type == y.device.type == p.device.type == "cpu"
        assert torch.equal(x == tok.bos_id, p == 0)  # a document starts at its <bos>
        assert torch.equal(x[:, 1:], y[:, :-1])
        assert int(x.max()) < tok.n_words
    # Documents are packed with BOS/EOS: the stream is <bos> doc <eos> <bos> doc <eos> ...
    # Window i of the stream is inputs[i] followed by the last label of row i.
    flat = torch.cat([torch.cat([x, y[:, -1:]], dim=1).flatten() for x, y, _ in step])
    assert flat[0] == tok.bos_id
    eos_at = (flat[:-1] == tok.eos_id).nonzero().flatten()
    assert len(eos_at) > 0 and bool((flat[eos_at + 1] == tok.bos_id).all())
    assert tok.decode(flat[1:eos_at[0]].tolist()) in _docs()


@pytest.mark.parametrize("degree,batch,accum", [(2, 4, 1), (4, 2, 1), (2, 2, 2), (4, 1, 2), (1, 2, 4)])
def test_global_batch_is_layout_independent(tok, degree, batch, accum):
    reference = loader(tok, batch=8, accum=1, rank=0, degree=1)
    ranks = [loader(tok, batch, accum, r, degree) for r in range(degree)]
    for _ in range(3):
        ref = global_batch([reference])
        got = global_batch(ranks)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert {str(ld.state_dict()) for ld in ranks} == {str(reference.state_dict())}


def test_seed_changes_order(tok):
    a = next(loader(tok, 4, 1, 0, 1, seed=0))[0][0]
    b = next(loader(tok, 4, 1, 0, 1, seed=1))[0][0]
    assert not torch.equal(a, b)


def test_resume_same_and_other_dp_degree(tok):
    ranks = [loader(tok, 4, 1, r, 2) for r in range(2)]
    for _ in range(5):
        global_batch(ranks)
    state = json.loads(json.dumps(ranks[0].state_dict()))  # plain data, the same on every rank
    assert state == ranks[1].state_dict() and state["sequence"] == 5 * 8
    expected = global_batch(ranks)
    # Restored under the same dp degree, under dp 1, and under dp 4 with accumulation.
    for degree, batch, accum in [(2, 4, 1), (1, 8, 1), (4, 1, 2)]:
        got = global_batch([_resumed(tok, state, batch, accum, r, degree) for r in range(degree)])
        assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))


def _resumed(tok, state, batch, accum, rank, degree):
    ld = loader(tok, batch, accum, rank, degree)
    ld.load_state_dict(state)
    return ld


def test_resume_across_epochs(tok, tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": f"document {i} " * (i % 7 + 1)}) + "\n" for i in range(40)))
    ld = loader(tok, 4, 1, 0, 1, dataset="json", path=str(path))
    for _ in range(7):
        next(ld)
    state = ld.state_dict()
    assert state["epoch"] >= 1  # wrapped around the 40 documents
    nxt = next(ld)
    other = loader(tok, 2, 2, 0, 1, dataset="json", path=str(path))
    other.load_state_dict(state)
    got = next(other)
    assert torch.equal(torch.cat([x for x, _, _ in got]), nxt[0][0])
    assert torch.equal(torch.cat([p for _, _, p in got]), nxt[0][2])
    with pytest.raises(ValueError, match="seed"):
        loader(tok, 4, 1, 0, 1, seed=5, dataset="json", path=str(path)).load_state_dict(state)


def _docs():
    return [f"Document number {i}. " + "Sparse is better than dense. " * (i % 5 + 1) for i in range(30)]


@pytest.mark.parametrize("fmt", ["jsonl", "text", "parquet"])
def test_local_files(tok, tmp_path, fmt):
    docs = _docs()
    if fmt == "jsonl":
        path = tmp_path / "train.jsonl"
        path.write_text("".join(json.dumps({"body": d}) + "\n" for d in docs))
        kw = {"text_field": "body"}
    elif fmt == "text":
        path = tmp_path / "train.txt"
        path.write_text("\n".join(docs) + "\n")
        kw = {}
    else:
        import datasets

        path = tmp_path / "train.parquet"
        datasets.Dataset.from_dict({"text": docs}).to_parquet(str(path))
        kw = {}
    builder = {"jsonl": "json", "text": "text", "parquet": "parquet"}[fmt]
    seen = set()
    for dataset, dataset_path in [(builder, str(path)), ("auto", str(path)), (str(path), None)]:
        ld = loader(tok, 2, 1, 0, 1, dataset=dataset, path=dataset_path, **kw)
        x, _, _ = next(ld)[0]
        seen.add(tuple(x.flatten().tolist()))
        assert "Document number" in tok.decode(x[0].tolist())
    assert len(seen) == 1  # same data whichever way the format is named


def test_validation_split_and_streaming(tok, tmp_path):
    val = loader(tok, 2, 1, 0, 1, split="validation")
    x, y, _ = next(val)[0]
    assert x.shape == (2, SEQ) and torch.equal(x[:, 1:], y[:, :-1])
    with pytest.raises(ValueError, match="splits"):
        loader(tok, 2, 1, 0, 1, split="test")
    # Streaming reads documents in order and resumes from the dataset's own state.
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in _docs()))
    stream = loader(tok, 2, 1, 0, 1, dataset="json", path=str(path), streaming=True)
    in_order = loader(tok, 2, 1, 0, 1, dataset="json", path=str(path), split="validation")
    first = next(stream)[0][0]
    assert torch.equal(first, next(in_order)[0][0])  # non-train map-style splits are unshuffled
    for _ in range(3):
        next(stream)
    state = stream.state_dict()
    expected, _, expected_positions = next(stream)[0]
    resumed = loader(tok, 1, 2, 0, 1, dataset="json", path=str(path), streaming=True)
    resumed.load_state_dict(state)
    got = next(resumed)
    assert torch.equal(torch.cat([x for x, _, _ in got]), expected)
    assert torch.equal(torch.cat([p for _, _, p in got]), expected_positions)
    # A resumed loader saves a position that resumes correctly too (and through an epoch wrap).
    again = loader(tok, 2, 1, 0, 1, dataset="json", path=str(path), streaming=True)
    again.load_state_dict(resumed.state_dict())
    for _ in range(30):
        assert torch.equal(next(again)[0][0], next(stream)[0][0])
    assert again.state_dict()["epoch"] >= 1
    # Rewinding a restored loader to the start forgets the earlier restore.
    start = loader(tok, 2, 1, 0, 1, dataset="json", path=str(path), streaming=True).state_dict()
    rewind = loader(tok, 2, 1, 0, 1, dataset="json", path=str(path), streaming=True)
    rewind.load_state_dict(state)
    next(rewind)
    rewind.load_state_dict(start)
    assert torch.equal(next(rewind)[0][0], first)


def test_errors(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        loader(tok, 2, 1, 0, 1, dataset="json", path=str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="dataset_path"):
        loader(tok, 2, 1, 0, 1, dataset="parquet")
    with pytest.raises(ValueError, match="dp_rank"):
        loader(tok, 2, 1, 2, 2)
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({"content": "x"}) + "\n")
    with pytest.raises(KeyError, match="content"):
        loader(tok, 2, 1, 0, 1, dataset="json", path=str(path))
