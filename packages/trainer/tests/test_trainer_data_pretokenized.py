"""Pre-tokenised path: `pretokenize` (datasets.map with 2 processes) writes memory-mapped tokens;
the loader reading them gives the on-the-fly batches for dp 1, 2, 4 and after resume, and each
rank reads exactly its own rows' tokens from the file."""

import json

import numpy as np
import pytest
import torch

from plait.data import build_dataloader, build_tokenizer
from plait.data.pretokenize import main as pretokenize_main
from plait.data.sources import DataError

SEQ, GLOBAL, STEPS = 32, 8, 12


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretok")
    path = root / "train.jsonl"
    docs = [f"Document {i}: " + "Now is better than never. " * (1 + (i * 5) % 11) for i in range(60)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    assert pretokenize_main(["--dataset", "json", "--dataset-path", str(path), "--output", str(root / "tokens"),
                             "--num-proc", "2"]) == 0
    return str(path), str(root / "tokens")


def steps(ld, n):
    """[n, rows, 2 * SEQ]: each row's inputs, then its document positions (compared together)."""
    return torch.stack([torch.cat([torch.cat([x, p.long()], dim=1) for x, _, p in next(ld)]) for _ in range(n)])


def test_files_hold_the_on_the_fly_tokens(tok, corpus):
    path, folder = corpus
    meta = json.loads(open(f"{folder}/meta.json").read())
    offsets = np.load(f"{folder}/offsets.npy")
    tokens = np.memmap(f"{folder}/tokens.bin", dtype=np.uint32, mode="r")
    docs = [json.loads(line)["text"] for line in open(path)]
    assert meta["num_documents"] == len(docs) and offsets[-1] == meta["num_tokens"]
    for i in (0, 7, len(docs) - 1):
        assert tokens[offsets[i] : offsets[i + 1]].tolist() == tok.encode(docs[i], bos=True, eos=True)


def test_same_batches_as_on_the_fly_for_every_degree_and_resume(tok, corpus):
    path, folder = corpus
    reference = steps(build_dataloader("json", path, tok, SEQ, GLOBAL, 1, 0, 1, 0), STEPS)  # crosses epochs
    for degree in (1, 2, 4):
        ranks = [build_dataloader("tokens", folder, tok, SEQ, GLOBAL // degree, 1, r, degree, 0) for r in range(degree)]
        got = torch.cat([steps(ld, STEPS) for ld in ranks], dim=1)
        assert torch.equal(got, reference), degree
        for ld in ranks:  # a rank read its rows and nothing else, tokenised nothing
            assert ld.documents.tokens_read == STEPS * (GLOBAL // degree) * (SEQ + 1) and ld.encoded_documents == 0
    half = build_dataloader("tokens", folder, tok, SEQ, GLOBAL // 2, 1, 1, 2, 0)
    steps(half, 5)
    state = json.loads(json.dumps(half.state_dict()))
    # The position is the on-the-fly loader's too: either path resumes the other.
    for dataset, data_path in (("tokens", folder), ("json", path)):
        resumed = build_dataloader(dataset, data_path, tok, SEQ, GLOBAL, 1, 0, 1, 0)
        resumed.load_state_dict(state)
        assert torch.equal(steps(resumed, 3), reference[5:8])


def test_errors(tok, corpus, tmp_path):
    _, folder = corpus
    with pytest.raises(FileNotFoundError, match="not a pre-tokenised folder"):
        build_dataloader("tokens", str(tmp_path), tok, SEQ, 2, 1, 0, 1, 0)
    meta = json.loads(open(f"{folder}/meta.json").read())
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in ("tokens.bin", "offsets.npy"):
        (bad / name).write_bytes(open(f"{folder}/{name}", "rb").read())
    (bad / "meta.json").write_text(json.dumps({**meta, "n_words": 128256}))
    with pytest.raises(DataError, match="not this run's tokenizer.*set model.tokenizer_path"):
        build_dataloader("tokens", str(bad), tok, SEQ, 2, 1, 0, 1, 0)
    (bad / "meta.json").write_text(json.dumps({**meta, "num_tokens": meta["num_tokens"] + 10}))
    with pytest.raises(DataError, match="do not match meta.json"):
        build_dataloader("tokens", str(bad), tok, SEQ, 2, 1, 0, 1, 0)
    # A meta.json missing a key: one line naming it, not KeyError (issue 40 fault probe 18).
    (bad / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "num_tokens"}))
    with pytest.raises(DataError, match="meta.json lacks num_tokens"):
        build_dataloader("tokens", str(bad), tok, SEQ, 2, 1, 0, 1, 0)


def test_validation_checks_the_folder_before_the_model(corpus, tmp_path):
    from plait.trainer.config import ConfigError, build_config
    from plait.trainer.validate import validate

    _, folder = corpus
    assert validate(build_config(None, [("data.dataset", "tokens"), ("data.dataset_path", folder)]), 1)
    meta = json.loads(open(f"{folder}/meta.json").read())
    bad = tmp_path / "other_tokenizer"
    bad.mkdir()
    for name in ("tokens.bin", "offsets.npy"):
        (bad / name).write_bytes(open(f"{folder}/{name}", "rb").read())
    (bad / "meta.json").write_text(json.dumps({**meta, "bos_id": 5}))
    with pytest.raises(ConfigError, match="data.dataset = 'tokens': .*not this run's tokenizer"):
        validate(build_config(None, [("data.dataset", "tokens"), ("data.dataset_path", str(bad))]), 1)
    with pytest.raises(ConfigError, match="not a pre-tokenised folder"):
        validate(build_config(None, [("data.dataset", "tokens"), ("data.dataset_path", str(tmp_path))]), 1)
