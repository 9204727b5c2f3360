"""Documents in stream order: a map-style dataset in a seeded per-epoch permutation (or in order),
or a streaming dataset in its own order, both forever.

A reader hands out `Document`s (position, and for streaming the text) without tokenising them;
`tokens(doc)` tokenises one, and the shared stream calls it only on the rank that owns it.
"""

from __future__ import annotations

import itertools

import numpy as np

from .errors import DataError, read_error
from .tokenizer import Tokenizer

# Token ids of the built-in corpus, per (split, tokenizer file, vocab size): a list with one
# entry per document, filled as documents are first read. The corpus is small (~0.7 M tokens),
# so after one epoch no step tokenises anything.
_BUILTIN_TOKENS: dict[tuple[str, str, int], tuple[list, list[np.ndarray | None]]] = {}


class Document:
    __slots__ = ("epoch", "doc", "hf_state", "index", "text", "length", "tokens")

    def __init__(self, epoch: int, doc: int, hf_state=None, index: int = -1, text=None):
        self.epoch, self.doc, self.hf_state, self.index, self.text = epoch, doc, hf_state, index, text
        self.length: int = -1  # known on every rank once resolved
        self.tokens: np.ndarray | None = None  # only on the rank that tokenised it


def encode(tokenizer: Tokenizer, text, where: str) -> np.ndarray:
    if not isinstance(text, str):
        what = "no text (null)" if text is None else f"a {type(text).__name__} text ({str(text)[:40]!r})"
        raise DataError(f"{where} has {what}: every row needs a string in data.text_field; "
                        "remove or fix that row (or set data.text_field to the text column)")
    return np.asarray(tokenizer.encode(text, bos=True, eos=True), dtype=np.int32)


class MapDocuments:
    """Random-access documents, visited in a seeded per-epoch permutation (or in order)."""

    def __init__(self, ds, text_field: str, tokenizer: Tokenizer, seed: int, shuffle: bool,
                 cache_key: tuple[str, str, int] | None = None, name: str = "the dataset"):
        if text_field not in ds.column_names:
            raise KeyError(f"text_field {text_field!r} is not a column of the dataset; "
                           f"columns: {ds.column_names}")
        if len(ds) == 0:
            raise DataError(f"{name} has no documents: give a file with at least one row")
        self.ds, self.text_field, self.tokenizer, self.name = ds, text_field, tokenizer, name
        self.seed, self.shuffle = seed, shuffle
        self.num_documents = len(ds)
        self._texts: list | None = None
        self._cache: list[np.ndarray | None] | None = None
        if cache_key is not None:
            if cache_key not in _BUILTIN_TOKENS:
                _BUILTIN_TOKENS[cache_key] = (list(ds[text_field]), [None] * len(ds))
            self._texts, self._cache = _BUILTIN_TOKENS[cache_key]
        self._order_epoch, self._order = -1, np.arange(0)
        self.epoch = self.doc = 0

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_documents)
            else:
                self._order = np.arange(self.num_documents)
            self._order_epoch = epoch
        return self._order

    def seek(self, epoch: int, doc: int, hf_state=None) -> None:
        self.epoch, self.doc = epoch, doc

    def read(self) -> Document:
        d = Document(self.epoch, self.doc, index=int(self.order(self.epoch)[self.doc]))
        self.doc += 1
        if self.doc == self.num_documents:
            self.epoch, self.doc = self.epoch + 1, 0
        return d

    def tokens(self, d: Document) -> tuple[np.ndarray, bool]:
        """(token ids, whether they were tokenised now rather than cached)."""
        if self._cache is not None:
            cached = self._cache[d.index]
            if cached is not None:
                return cached, False
            cached = self._cache[d.index] = encode(self.tokenizer, self._texts[d.index], self._where(d))
            return cached, True
        try:
            text = self.ds[d.index][self.text_field]
        except Exception as e:  # e.g. bytes that are not UTF-8, kept by the JSON reader until read
            raise read_error(e, self._where(d)) from None
        return encode(self.tokenizer, text, self._where(d)), True

    def _where(self, d: Document) -> str:
        return f"row {d.index} of {self.name}"


class StreamDocuments:
    """Documents of an IterableDataset, in order, epoch after epoch; resumable through its
    own state_dict (or by skipping when it has none)."""

    def __init__(self, ds, text_field: str, tokenizer: Tokenizer, name: str = "the dataset",
                 split: tuple[int, int] | None = None):
        if split is not None:
            # Rank r of R reads only its part: whole shards when R divides the shard count, else
            # every R-th example (then the global order is the unsplit one).
            from datasets.distributed import split_dataset_by_node

            ds = split_dataset_by_node(ds, rank=split[0], world_size=split[1])
        self.split = split
        self.documents_read = 0  # examples this rank pulled from the stream (tests, benchmarks)
        self.ds, self.text_field, self.tokenizer, self.name = ds, text_field, tokenizer, name
        self._iter = None
        self._epoch, self._doc, self._resume_state = 0, 0, None
        self._loaded_state = False  # whether ds holds a starting state from load_state_dict

    def seek(self, epoch: int, doc: int, hf_state: dict | None) -> None:
        self._iter, self._epoch, self._doc, self._resume_state = None, epoch, doc, hf_state

    def read(self) -> Document:
        """The next document (its text), with the dataset's state before it."""
        while True:
            if self._iter is None:
                state = self._resume_state  # the state before this doc, as saved
                self._iter = self._start_epoch()
            elif self._doc > 0 and hasattr(self.ds, "state_dict"):
                state = self.ds.state_dict()
            else:
                state = None
            try:
                example = next(self._iter)
            except StopIteration:
                if self._doc == 0:
                    raise DataError(f"{self.name} has no documents: give data with at least one row") from None
                self._iter, self._epoch, self._doc = None, self._epoch + 1, 0
                continue
            except Exception as e:  # the files are read lazily: a bad byte shows up here
                raise read_error(e, self.name) from None
            if self.text_field not in example:
                raise KeyError(f"text_field {self.text_field!r} not in the dataset's examples; "
                               f"keys: {sorted(example)}")
            d = Document(self._epoch, self._doc, hf_state=state, text=example[self.text_field])
            self._doc += 1
            self.documents_read += 1
            return d

    def tokens(self, d: Document) -> tuple[np.ndarray, bool]:
        tokens = encode(self.tokenizer, d.text, f"document {d.doc} (epoch {d.epoch}) of {self.name}")
        d.text = None  # keep only the tokens
        return tokens, True

    def _start_epoch(self):
        if hasattr(self.ds, "set_epoch"):
            self.ds.set_epoch(self._epoch)
        state, self._resume_state = self._resume_state, None
        if state is not None:
            self.ds.load_state_dict(state)  # applies to this epoch only (datasets checks it)
            self._loaded_state = True
            return iter(self.ds)
        if self._loaded_state:  # forget an earlier restore's starting point
            self.ds.load_state_dict(None)
            self._loaded_state = False
        # No saved dataset state: skip to the document (reads through the skipped ones).
        return itertools.islice(iter(self.ds), self._doc, None)
