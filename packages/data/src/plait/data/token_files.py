"""Documents of a pre-tokenised folder (`pretokenize.py`): token ids memory-mapped, lengths from
the offsets, visited in the same seeded per-epoch permutation as `MapDocuments`, so the stream —
and every batch — equals the on-the-fly path's over the same dataset and tokenizer."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .documents import Document, MapDocuments
from .errors import DataError
from .token_format import OFFSETS_FILE, TOKENS_FILE, read_meta, tokenizer_sha256


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
    try:
        return tokenizer_sha256(tokenizer)
    except (OSError, AttributeError, TypeError):  # a tokenizer not read from a file (tests' stand-ins)
        return None
