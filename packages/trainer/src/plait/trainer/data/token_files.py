"""Documents of a pre-tokenised folder (`pretokenize.py`): token ids memory-mapped, lengths from
the offsets, visited in the same seeded per-epoch permutation as `MapDocuments`, so the stream —
and every batch — equals the on-the-fly path's over the same dataset and tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from .documents import Document, MapDocuments
from .pretokenize import META_FILE, OFFSETS_FILE, TOKENS_FILE
from .sources import DataError


def read_meta(folder: str | Path) -> dict:
    """meta.json of a token folder, checking the files it describes are there and whole."""
    folder = Path(folder)
    fix = "write it with python -m plait.trainer.data.pretokenize"
    if not (folder / META_FILE).is_file():
        raise FileNotFoundError(f"{folder} is not a pre-tokenised folder (no {META_FILE}): {fix}")
    try:
        meta = json.loads((folder / META_FILE).read_text())
        offsets = np.load(folder / OFFSETS_FILE, mmap_mode="r")
    except (OSError, ValueError) as e:
        raise DataError(f"{folder}: {META_FILE} or {OFFSETS_FILE} cannot be read ({e}); {fix}") from None
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


class TokenFileDocuments(MapDocuments):
    """Random-access documents whose lengths are known without reading them (`length`)."""

    def __init__(self, folder: str | Path, tokenizer, seed: int, shuffle: bool, split: str = "train"):
        meta = read_meta(folder)
        if meta.get("split", split) != split:
            raise DataError(f"{folder} holds the {meta['split']!r} split, not {split!r}: pre-tokenise that split "
                            "into its own folder")
        ours = (tokenizer.n_words, tokenizer.bos_id, tokenizer.eos_id)
        if (meta["n_words"], meta["bos_id"], meta["eos_id"]) != ours:
            raise DataError(f"{folder} was tokenised with {meta['tokenizer']} ({meta['n_words']} ids, bos "
                            f"{meta['bos_id']}, eos {meta['eos_id']}), not this run's tokenizer ({ours[0]} ids, bos "
                            f"{ours[1]}, eos {ours[2]}): set model.tokenizer_path to it, or pre-tokenise again")
        ours_sha = _tokenizer_sha256(tokenizer)
        if meta.get("tokenizer_sha256") and ours_sha and meta["tokenizer_sha256"] != ours_sha:
            raise DataError(f"{folder} was tokenised with {meta['tokenizer']} (sha256 {meta['tokenizer_sha256'][:12]}), "
                            f"not this run's tokenizer {tokenizer.model_path} (sha256 {ours_sha[:12]}), though they "
                            "have the same size: set model.tokenizer_path to it, or pre-tokenise again")
        if meta.get("max_id", -1) >= tokenizer.n_words:
            raise DataError(f"{folder} holds token id {meta['max_id']}, outside this run's tokenizer of "
                            f"{tokenizer.n_words} ids: pre-tokenise it with this run's tokenizer")
        self.n_words = tokenizer.n_words
        self.name, self.seed, self.shuffle = str(folder), seed, shuffle
        self.num_documents = meta["num_documents"]
        self.offsets = np.load(Path(folder) / OFFSETS_FILE)
        self.token_ids = np.memmap(Path(folder) / TOKENS_FILE, dtype=np.uint32, mode="r")
        self._order_epoch, self._order = -1, np.arange(0)
        self.epoch = self.doc = 0
        self.tokens_read = 0  # tokens this rank read from the file (tests, benchmarks)

    def length(self, d: Document) -> int:
        return int(self.offsets[d.index + 1] - self.offsets[d.index])

    def slice(self, d: Document, start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) of document d, read from the mapped file (only those pages)."""
        base = int(self.offsets[d.index])
        self.tokens_read += stop - start
        ids = self.token_ids[base + start : base + stop]
        # What is read is checked (the rows of a step, on the host): an id past the vocabulary
        # would be an IndexError in the embedding (a device-side assert on GPU).
        if len(ids) and int(ids.max()) >= self.n_words:
            raise DataError(f"{self.name}: document {d.index} holds token id {int(ids.max())}, outside this run's "
                            f"tokenizer of {self.n_words} ids (a damaged {TOKENS_FILE}?): pre-tokenise it again")
        return ids.astype(np.int32)


def _tokenizer_sha256(tokenizer) -> str | None:
    from .pretokenize import tokenizer_sha256

    try:
        return tokenizer_sha256(tokenizer)
    except (OSError, AttributeError, TypeError):  # a tokenizer not read from a file (tests' stand-ins)
        return None
