"""A pre-tokenised folder is checked before it is trained on (issue 27, defect 4): ids past the
vocabulary, offsets going backwards, a tokens.bin that is not the one meta.json describes, another
tokenizer of the same size, all-empty documents, and plait-pretokenize never leaves a half folder
nor writes over a file. Real folders written by plait-pretokenize, then damaged."""

import json
import shutil
import signal

import numpy as np
import pytest

from plait.data import build_dataloader, build_tokenizer
from plait.data import pretokenize as pretok
from plait.data.sources import DataError
from plait.trainer.config import ConfigError, build_config
from plait.trainer.validate import validate


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokchecks")
    path = root / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"Document {i}: " + "Flat is better than nested. " * (1 + i % 4)})
                            + "\n" for i in range(12)))
    assert pretok.main(["--dataset", "json", "--dataset-path", str(path), "--output", str(root / "tokens")]) == 0
    return path, root / "tokens"


def copy(folder, tmp_path, name="copy"):
    out = tmp_path / name
    shutil.copytree(folder, out)
    return out


def meta_of(folder):
    return json.loads((folder / "meta.json").read_text())


def write_meta(folder, **changes):
    (folder / "meta.json").write_text(json.dumps({**meta_of(folder), **changes}))


def loader(folder, tok):
    return build_dataloader("tokens", str(folder), tok, 16, 2, 1, 0, 1, 0)


def check(folder):
    return validate(build_config(None, [("data.dataset", "tokens"), ("data.dataset_path", str(folder)),
                                        ("training.seq_len", "64")]), 1)


def test_meta_records_max_id_and_tokenizer_identity(corpus, tok):
    _, folder = corpus
    meta = meta_of(folder)
    tokens = np.memmap(folder / "tokens.bin", dtype=np.uint32, mode="r")
    assert meta["max_id"] == int(tokens.max()) < tok.n_words
    assert meta["tokenizer_sha256"] == pretok.tokenizer_sha256(tok) and len(meta["tokenizer_sha256"]) == 64
    assert check(folder)
    assert not [p.name for p in folder.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_ids_past_the_vocabulary(corpus, tok, tmp_path):
    _, folder = corpus
    bad = copy(folder, tmp_path)
    tokens = np.memmap(bad / "tokens.bin", dtype=np.uint32, mode="r+")
    tokens[3] = 999_999
    tokens.flush()
    write_meta(bad, max_id=999_999)  # as pretokenize records it: refused before the model is built
    with pytest.raises(ConfigError, match=f"holds token id 999999, outside this run's tokenizer of {tok.n_words} ids"):
        check(bad)
    write_meta(bad, max_id=None)  # a folder from before max_id: what is read is checked
    meta = meta_of(bad)
    del meta["max_id"]
    (bad / "meta.json").write_text(json.dumps(meta))
    ld = loader(bad, tok)
    with pytest.raises(DataError, match="document 0 holds token id 999999, outside this run's tokenizer"):
        for _ in range(40):
            next(ld)


def test_offsets_going_backwards(corpus, tok, tmp_path):
    _, folder = corpus
    bad = copy(folder, tmp_path)
    offsets = np.load(bad / "offsets.npy")
    offsets[[2, 3]] = offsets[[3, 2]]
    np.save(bad / "offsets.npy", offsets)
    with pytest.raises(DataError, match="offsets.npy go backwards at document 2"):
        loader(bad, tok)
    with pytest.raises(ConfigError, match="go backwards at document 2"):
        check(bad)


def test_tokens_bin_not_matching_meta(corpus, tok, tmp_path):
    _, folder = corpus
    bad = copy(folder, tmp_path)
    with open(bad / "tokens.bin", "ab") as f:  # a longer file: another run's tokens
        f.write(b"\0" * 400)
    with pytest.raises(DataError, match="tokens.bin .* do not match meta.json"):
        loader(bad, tok)


@pytest.mark.parametrize("field, value", [("num_tokens", "1234"), ("num_documents", 2.5), ("n_words", True)])
def test_a_count_in_meta_that_is_not_a_number(corpus, tok, tmp_path, field, value):
    """Issue 53: a string num_tokens was a TypeError traceback."""
    _, folder = corpus
    bad = copy(folder, tmp_path)
    write_meta(bad, **{field: value})
    with pytest.raises(DataError, match=f"meta.json has {field} = {value!r}, not a whole number >= 0"):
        loader(bad, tok)


def test_another_tokenizer_of_the_same_size(corpus, tok, tmp_path):
    from plait.data.tokenizer import read_bpe_ranks, write_bpe_ranks

    path, folder = corpus
    ranks = read_bpe_ranks(tok.model_path)
    a, b = list(ranks)[300], list(ranks)[301]
    ranks[a], ranks[b] = ranks[b], ranks[a]  # same size, same special ids, other ids for two pieces
    write_bpe_ranks(ranks, tmp_path / "other.model")
    assert pretok.main(["--dataset", "json", "--dataset-path", str(path), "--output", str(tmp_path / "t"),
                        "--tokenizer", str(tmp_path / "other.model")]) == 0
    assert meta_of(tmp_path / "t")["n_words"] == tok.n_words
    with pytest.raises(DataError, match="though they have the same size: set model.tokenizer_path"):
        loader(tmp_path / "t", tok)
    assert loader(tmp_path / "t", build_tokenizer(str(tmp_path / "other.model")))


def test_all_empty_documents_are_an_error_not_a_hang(corpus, tok, tmp_path):
    _, folder = corpus
    bad = copy(folder, tmp_path)
    np.save(bad / "offsets.npy", np.zeros(meta_of(bad)["num_documents"] + 1, np.int64))
    (bad / "tokens.bin").write_bytes(b"\0" * 4)
    write_meta(bad, num_tokens=0)
    signal.alarm(30)  # before the fix the loader looped forever looking for a token
    try:
        with pytest.raises(DataError, match="every document is empty"):
            next(loader(bad, tok))
    finally:
        signal.alarm(0)


def test_interrupted_pretokenize_leaves_the_previous_folder(corpus, tmp_path, monkeypatch):
    path, folder = corpus
    out = copy(folder, tmp_path, "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(pretok.np, "save", interrupted)  # after tokens.bin is written
    with pytest.raises(KeyboardInterrupt):
        pretok.pretokenize("json", str(path), out)
    monkeypatch.undo()
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left
    assert pretok.main(["--dataset", "json", "--dataset-path", str(path), "--output", str(out)]) == 0  # re-run


def test_output_naming_a_file_or_someone_elses_folder(corpus, tmp_path, capsys):
    path, _ = corpus
    (tmp_path / "notes.txt").write_text("mine")
    assert pretok.main(["--dataset", "json", "--dataset-path", str(path), "--output", str(tmp_path / "notes.txt")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pretokenize: error: --output") and "is an existing file" in err and "\n" not in err
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "thesis.tex").write_text("mine")
    assert pretok.main(["--dataset", "json", "--dataset-path", str(path), "--output", str(tmp_path / "docs")]) == 2
    assert "not a pre-tokenised folder" in capsys.readouterr().err
    assert (tmp_path / "notes.txt").read_text() == "mine" and (tmp_path / "docs" / "thesis.tex").read_text() == "mine"
