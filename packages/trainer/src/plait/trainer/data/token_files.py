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
    if len(offsets) != meta["num_documents"] + 1 or size < 4 * meta["num_tokens"]:
        raise DataError(f"{folder}: {TOKENS_FILE} / {OFFSETS_FILE} do not match {META_FILE} (an interrupted "
                        f"write?); {fix}")
    if meta["num_documents"] == 0:
        raise DataError(f"{folder} has no documents: pre-tokenise a dataset with at least one row")
    return meta


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
        return self.token_ids[base + start : base + stop].astype(np.int32)
