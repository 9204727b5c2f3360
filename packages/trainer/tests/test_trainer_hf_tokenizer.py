"""A Hugging Face tokenizer.json, built here with `tokenizers` (nothing downloaded): chosen by the
file given, BOS/EOS from tokenizer_config.json, round trip, specials as plain text, and a loader."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from plait.data import build_dataloader, build_tokenizer
from plait.data.hf_tokenizer import HFTokenizer
from plait.data.tokenizer import Tokenizer as TiktokenTokenizer

# DeepSeek-V3's special-token names (full-width bars and the lower-one-eighth block).
BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
CORPUS = ["Beautiful is better than ugly.", "Explicit is better than implicit.", "def f(x):\n    return x"] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("hf_tok")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", BOS, EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": {"content": BOS}, "eos_token": EOS, "tokenizer_class": "LlamaTokenizerFast"}))
    return folder


def test_chosen_by_file_with_bos_eos_from_config(tokenizer_dir):
    for given in (tokenizer_dir / "tokenizer.json", tokenizer_dir):
        tok = build_tokenizer(str(given))
        assert isinstance(tok, HFTokenizer)
        vocab = json.loads((tokenizer_dir / "tokenizer.json").read_text())["model"]["vocab"]
        assert (tok.bos_id, tok.eos_id) == (1, 2) and tok.n_words == len(vocab)
    assert isinstance(build_tokenizer(None), TiktokenTokenizer)


def test_round_trip_and_special_text(tokenizer_dir):
    tok = build_tokenizer(str(tokenizer_dir / "tokenizer.json"))
    text = "Explicit is better than implicit, héllo 🙂\n\tdef g(): pass"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids[1:-1]) == text
    assert len(tok.encode("Beautiful is better than ugly.", False, False)) < 8  # merges learned
    plain = tok.encode(BOS, bos=False, eos=False)
    assert tok.bos_id not in plain and tok.decode(plain) == BOS  # data cannot inject control tokens
    assert tok.encode(BOS, False, False, allow_special=True) == [tok.bos_id]
    assert tok.encode_batch([text, "x"], True, False) == [ids[:-1], tok.encode("x", True, False)]


def test_loader_packs_with_its_bos_eos(tokenizer_dir, tmp_path):
    tok = build_tokenizer(str(tokenizer_dir))
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in CORPUS))
    x, y, _ = next(build_dataloader("json", str(path), tok, 64, 2, 1, 0, 1, 0))[0]
    assert x[0, 0] == tok.bos_id and torch.equal(x[:, 1:], y[:, :-1]) and int(x.max()) < tok.n_words
    assert (x == tok.eos_id).any()


def test_errors_name_the_file_and_fix(tmp_path, tokenizer_dir):
    with pytest.raises(FileNotFoundError, match="missing"):
        build_tokenizer(str(tmp_path / "missing" / "tokenizer.json"))
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="is not a Hugging Face tokenizer.json"):
        build_tokenizer(str(bad))
    # No config and no well-known names: say which file to write.
    folder = tmp_path / "noconfig"
    folder.mkdir()
    raw = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    for added in raw["added_tokens"]:
        added["content"] = added["content"].replace("▁", "_")
    for name in list(raw["model"]["vocab"]):
        if "▁" in name:
            raw["model"]["vocab"][name.replace("▁", "_")] = raw["model"]["vocab"].pop(name)
    (folder / "tokenizer.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="tokenizer_config.json"):
        build_tokenizer(str(folder))


def test_trainer_validation_takes_it(tokenizer_dir, tmp_path):
    from plait.trainer.config import ConfigError, build_config
    from plait.trainer.validate import validate

    plan = validate(build_config(None, [("model.tokenizer_path", str(tokenizer_dir / "tokenizer.json"))]), 1)
    assert isinstance(plan.tokenizer, HFTokenizer)
    (tmp_path / "tokenizer.json").write_text("[]")
    with pytest.raises(ConfigError, match="is not a Hugging Face tokenizer.json"):
        validate(build_config(None, [("model.tokenizer_path", str(tmp_path / "tokenizer.json"))]), 1)
