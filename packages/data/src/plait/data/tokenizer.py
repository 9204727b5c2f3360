"""Llama 3's tokenizer: tiktoken byte-level BPE from a `tokenizer.model` file plus 256 specials
(`build_tokenizer` picks `hf_tokenizer.HFTokenizer` for a Hugging Face `tokenizer.json`).

The file format is Llama 3's: one `base64(token bytes) rank` pair per line, ranks 0..N-1 with the
256 single bytes among them so that any text encodes. The special tokens follow the BPE ranks
(ids N..N+255), named as in Llama 3.1, so the real file gives 128000 + 256 = 128256 ids and the
project's shipped one (`assets/tokenizer.model`, 1792 ranks) gives 2048, the debug model's vocab.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator, Sequence
from importlib import resources
from pathlib import Path

import tiktoken

# Llama 3's pre-tokenizer regex (contractions, letter runs, 1-3 digit groups, punctuation, spaces).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
NUM_RESERVED_SPECIAL_TOKENS = 256
_NAMED_SPECIALS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|reserved_special_token_0|>",
    "<|reserved_special_token_1|>",
    "<|finetune_right_pad_id|>",
    "<|step_id|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eom_id|>",
    "<|eot_id|>",
    "<|python_tag|>",
]
LLAMA3_SPECIAL_TOKENS = _NAMED_SPECIALS + [
    f"<|reserved_special_token_{2 + i}|>"
    for i in range(NUM_RESERVED_SPECIAL_TOKENS - len(_NAMED_SPECIALS))
]

# tiktoken's regex gets slow on very long inputs and very long runs of one character class;
# Meta's reference tokenizer cuts text the same way before encoding.
_MAX_ENCODE_CHARS = 400_000
_MAX_NO_WHITESPACE_CHARS = 25_000
_RUNS = re.compile(r"\s+|\S+")


def shipped_tokenizer_path() -> str:
    """Path of the small BPE file the project ships (built by scripts/build_tokenizer.py)."""
    return str(resources.files("plait.data") / "assets" / "tokenizer.model")


def read_bpe_ranks(path: str | Path) -> dict[bytes, int]:
    """Parse a tiktoken BPE file: `base64(token) rank` per line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {str(path)!r}")
    ranks: dict[bytes, int] = {}
    for line_no, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{line_no}: expected 'base64-token rank', got {line[:80]!r}") from e
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"{path}: {len(missing)} single bytes have no rank (e.g. {missing[0]}), "
                         "so some text could not be encoded")
    return ranks


def write_bpe_ranks(ranks: dict[bytes, int], path: str | Path) -> None:
    """Write ranks in the `tokenizer.model` format (sorted by rank)."""
    lines = [f"{base64.b64encode(tok).decode()} {rank}" for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])]
    Path(path).write_text("\n".join(lines) + "\n")


class Tokenizer:
    """Llama 3 tokenizer (tiktoken BPE + 256 special tokens). Works for any rank file."""

    def __init__(self, model_path: str | Path):
        self.model_path = str(model_path)
        ranks = read_bpe_ranks(model_path)
        self.num_base_tokens = len(ranks)
        self.special_tokens = {tok: self.num_base_tokens + i for i, tok in enumerate(LLAMA3_SPECIAL_TOKENS)}
        self.model = tiktoken.Encoding(
            name=Path(model_path).name,
            pat_str=LLAMA3_PATTERN,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words: int = self.model.n_vocab
        self.bos_id: int = self.special_tokens["<|begin_of_text|>"]
        self.eos_id: int = self.special_tokens["<|end_of_text|>"]
        self.pad_id: int = self.special_tokens["<|finetune_right_pad_id|>"]
        self.eot_id: int = self.special_tokens["<|eot_id|>"]

    def encode(self, text: str, bos: bool, eos: bool, allow_special: bool = False) -> list[int]:
        """Token ids of `text`, optionally wrapped in BOS/EOS.

        Special-token strings inside `text` are encoded as plain text unless `allow_special`
        (pretraining data must not be able to inject control tokens).
        """
        ids: list[int] = [self.bos_id] if bos else []
        for piece in _pieces(text):
            if allow_special:
                ids.extend(self.model.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.model.encode_ordinary(piece))
        if eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(self, texts: Sequence[str], bos: bool, eos: bool) -> list[list[int]]:
        return [self.encode(t, bos, eos) for t in texts]

    def decode(self, ids: Sequence[int]) -> str:
        return self.model.decode(list(ids))

    def __repr__(self) -> str:
        return f"Tokenizer({self.model_path!r}, n_words={self.n_words})"


def _pieces(text: str) -> Iterator[str]:
    """Cut text into pieces tiktoken's regex handles quickly (same cuts as Meta's reference)."""
    for start in range(0, len(text), _MAX_ENCODE_CHARS):
        yield from _split_long_runs(text[start : start + _MAX_ENCODE_CHARS])


def _split_long_runs(s: str) -> Iterator[str]:
    """Cut inside any run of only-space or only-non-space characters longer than the limit."""
    if len(s) <= _MAX_NO_WHITESPACE_CHARS:
        yield s
        return
    start = 0
    for run in _RUNS.finditer(s):
        if run.end() - run.start() > _MAX_NO_WHITESPACE_CHARS:
            for cut in range(run.start() + _MAX_NO_WHITESPACE_CHARS, run.end(), _MAX_NO_WHITESPACE_CHARS):
                yield s[start:cut]
                start = cut
    yield s[start:]


def is_hf_tokenizer(path: str) -> bool:
    """A Hugging Face `tokenizer.json` (or a folder holding one) rather than a tiktoken BPE file."""
    p = Path(path)
    return p.suffix == ".json" or p.is_dir()


def build_tokenizer(path: str | None = None):
    """The shipped BPE when `path` is None or "", a Hugging Face tokenizer for a `*.json` file or a
    folder with `tokenizer.json` (`HFTokenizer`), else a Llama 3 tiktoken `tokenizer.model`."""
    if path and is_hf_tokenizer(path):
        from .hf_tokenizer import HFTokenizer

        return HFTokenizer(path)
    return Tokenizer(path or shipped_tokenizer_path())
