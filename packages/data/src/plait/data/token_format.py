"""The on-disk format of a pre-tokenised folder, shared by its writer (`pretokenize.py`), its
reader (`token_files.py`) and the checks before the model is built (`sources.py`): the file
names, the meta check, and the tokenizer's identity.

    tokens.bin   np.uint32 ids, documents back to back (one placeholder id when empty)
    offsets.npy  int64, document i is tokens[offsets[i]:offsets[i + 1]]
    meta.json    num_documents, num_tokens, max_id, the tokenizer's size, specials and sha256
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .errors import DataError

TOKENS_FILE, OFFSETS_FILE, META_FILE = "tokens.bin", "offsets.npy", "meta.json"
# What every reader of meta.json needs (pretokenize.py writes them all).
REQUIRED_META = ("num_documents", "num_tokens", "n_words", "bos_id", "eos_id", "tokenizer")
INTEGER_META = ("num_documents", "num_tokens", "n_words")  # counts (ids may be -1 or None: none)


def tokenizer_sha256(tokenizer) -> str:
    """The identity of a tokenizer: the hash of the file it was read from (two tokenizers of the
    same size and special ids are still told apart)."""
    digest = hashlib.sha256()
    with open(tokenizer.model_path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_meta(folder: str | Path) -> dict:
    """meta.json of a token folder, checking the files it describes are there and whole."""
    folder = Path(folder)
    fix = "write it with python -m plait.data.pretokenize"
    if not (folder / META_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a pre-tokenised folder (no {META_FILE}): {fix}")
    try:
        meta = json.loads((folder / META_FILE).read_text())
        offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{folder}: {META_FILE} or {OFFSETS_FILE} cannot be read ({e}); {fix}") from None
    missing = [k for k in REQUIRED_META if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise DataError(f"{folder}: {META_FILE} lacks {', '.join(missing)} (not written by pretokenize, or edited); {fix}")
    # The counts and ids are whole numbers (a bool is not one; a string was a TypeError traceback).
    wrong = [f"{k} = {meta[k]!r}" for k in INTEGER_META if k in meta and (type(meta[k]) is not int or meta[k] < 0)]
    if wrong:
        raise DataError(f"{folder}: {META_FILE} has {', '.join(wrong)}, not a whole number >= 0 (edited?); {fix}")
    size = (folder / TOKENS_FILE).stat().st_size if (folder / TOKENS_FILE).is_file() else -1
    # pretokenize.py writes exactly the tokens (one placeholder id for an empty folder).
    if len(offsets) != meta["num_documents"] + 1 or size != 4 * max(meta["num_tokens"], 1):
        raise DataError(f"{folder}: {TOKENS_FILE} ({size} bytes) / {OFFSETS_FILE} ({len(offsets)} entries) do not "
                        f"match {META_FILE} ({meta['num_tokens']} tokens, {meta['num_documents']} documents; an "
                        f"interrupted or mixed write?); {fix}")
    if meta["num_documents"] == 0:
        raise DataError(f"{folder} has no documents: pre-tokenise a dataset with at least one row")
    bad = _offsets_problem(offsets, meta["num_tokens"])
    if bad:
        raise DataError(f"{folder}: {OFFSETS_FILE} {bad}; {fix}")
    if meta["num_tokens"] == 0:
        raise DataError(f"{folder}: every document is empty (0 tokens): there is nothing to train on; {fix} "
                        "from a dataset with text")
    return meta


def _offsets_problem(offsets: np.ndarray, num_tokens: int, block: int = 1 << 22) -> str | None:
    """Why `offsets` are not 0 = o[0] <= o[1] <= ... <= o[-1] = num_tokens (read in blocks:
    8 bytes a document, memory-mapped), or None."""
    if offsets[0] != 0 or offsets[-1] != num_tokens:
        return f"run from {int(offsets[0])} to {int(offsets[-1])}, not from 0 to num_tokens = {num_tokens}"
    for start in range(0, len(offsets) - 1, block):
        steps = np.diff(offsets[start : start + block + 1])
        if (steps < 0).any():
            doc = start + int(np.argmax(steps < 0))
            return (f"go backwards at document {doc} ({int(offsets[doc])} -> {int(offsets[doc + 1])}): "
                    "offsets must not decrease")
    return None
