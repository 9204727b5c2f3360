"""A Hugging Face `tokenizer.json` (DeepSeek-V3's, Qwen's, Llama's HF release...) through the
`tokenizers` library, with the interface of the tiktoken `Tokenizer`.

BOS and EOS come from the tokenizer's own config: `tokenizer_config.json` beside the file
(`bos_token` / `eos_token`, a string or `{"content": ...}`), as transformers reads them. Without
that file, a few well-known names among the added tokens are recognised; otherwise it is an error
naming the file to write.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import tokenizers

# BOS / EOS names of common tokenizer.json files, used only when no tokenizer_config.json says.
_KNOWN_BOS = ("<|begin_of_text|>", "<｜begin▁of▁sentence｜>", "<s>", "<|startoftext|>", "<bos>")
_KNOWN_EOS = ("<|end_of_text|>", "<｜end▁of▁sentence｜>", "</s>", "<|endoftext|>", "<eos>")


def _token_name(value) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


class HFTokenizer:
    """`tokenizer.json` via `tokenizers`; BOS/EOS from `tokenizer_config.json`."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {str(path)!r}")
        self.model_path = str(path)
        try:
            # Two instances: data text never becomes control tokens; `allow_special` opts in.
            self._plain = tokenizers.Tokenizer.from_file(str(path))
            self._special = tokenizers.Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception with serde's message
            raise ValueError(f"{path} is not a Hugging Face tokenizer.json ({e}); give a tokenizer.json "
                             "saved by `tokenizers`/transformers, or a tiktoken tokenizer.model") from None
        self._plain.encode_special_tokens = True
        vocab = self._special.get_vocab(with_added_tokens=True)
        self.n_words: int = max(vocab.values()) + 1
        self.special_tokens = {t.content: i for i, t in self._special.get_added_tokens_decoder().items()
                               if t.special}
        bos, eos = self._bos_eos(path, vocab)
        self.bos_id, self.eos_id = vocab[bos], vocab[eos]

    def _bos_eos(self, path: Path, vocab: dict[str, int]) -> tuple[str, str]:
        config_path = path.parent / "tokenizer_config.json"
        bos = eos = None
        if config_path.is_file():
            try:
                config = json.loads(config_path.read_text())
            except (ValueError, UnicodeDecodeError) as e:
                raise ValueError(f"{config_path} is not valid JSON ({e}); fix or remove it") from None
            bos, eos = _token_name(config.get("bos_token")), _token_name(config.get("eos_token"))
        bos = bos or next((t for t in _KNOWN_BOS if t in vocab), None)
        eos = eos or next((t for t in _KNOWN_EOS if t in vocab), None)
        for role, name in (("bos_token", bos), ("eos_token", eos)):
            if name is None:
                raise ValueError(f"{path}: no {role} known; write {config_path} with "
                                 f'{{"bos_token": "...", "eos_token": "..."}} naming tokens of the vocabulary')
            if name not in vocab:
                raise ValueError(f"{config_path}: {role} {name!r} is not in {path.name}'s vocabulary")
        return bos, eos

    def encode(self, text: str, bos: bool, eos: bool, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in BOS/EOS; special-token strings in `text` are
        plain text unless `allow_special` (data must not inject control tokens)."""
        tok = self._special if allow_special else self._plain
        ids = tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        encodings = self._plain.encode_batch(list(texts), add_special_tokens=False)
        return [([self.bos_id] if bos else []) + e.ids + ([self.eos_id] if eos else []) for e in encodings]

    def decode(self, ids: Sequence[int]) -> str:
        return self._special.decode(list(ids), skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"HFTokenizer({self.model_path!r}, n_words={self.n_words})"
