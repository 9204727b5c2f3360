"""Packed, layout-independent, resumable batches.

One deterministic token stream per (dataset, split, seed): documents in a per-epoch shuffled
order (map-style datasets; streaming datasets in their own order), each tokenised as
`<|begin_of_text|> text <|end_of_text|>`, concatenated across documents and epochs, and cut into
windows of `seq_len + 1` tokens. Window i is sequence i of the stream; its first `seq_len`
tokens are the inputs and its last `seq_len` the labels.

Step k's global batch is sequences [k*G, (k+1)*G) with G = local_batch_size * grad_accum *
dp_degree. Dp rank r takes the contiguous rows [r*L*A, (r+1)*L*A) (L = local_batch_size,
A = grad_accum) and micro-batch m the rows [m*L, (m+1)*L) of that slice. So the global batch,
and the loss averaged over it, is the same whatever the dp degree and accumulation split.

Every rank reads the whole global stream and keeps its slice, so every rank holds the same
position. The position (epoch, document, token offset in it) is the loader's state: restoring
it, under any dp degree or batch layout, continues the same stream.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch

from .sources import load_documents
from .tokenizer import Tokenizer

MicroBatch = tuple[torch.Tensor, torch.Tensor]

# Token ids of the built-in corpus, per (split, tokenizer file, vocab size): a list with one
# entry per document, filled as documents are first read. The corpus is small (~0.7 M tokens),
# so after one epoch no step tokenises anything.
_BUILTIN_TOKENS: dict[tuple[str, str, int], tuple[list[str], list[np.ndarray | None]]] = {}


class _MapDocuments:
    """Random-access documents, visited in a seeded per-epoch permutation (or in order)."""

    def __init__(self, ds, text_field: str, tokenizer: Tokenizer, seed: int, shuffle: bool,
                 cache_key: tuple[str, str, int] | None = None):
        if text_field not in ds.column_names:
            raise KeyError(f"text_field {text_field!r} is not a column of the dataset; "
                           f"columns: {ds.column_names}")
        if len(ds) == 0:
            raise ValueError("the dataset has no documents")
        self.ds, self.text_field, self.tokenizer = ds, text_field, tokenizer
        self.seed, self.shuffle = seed, shuffle
        self.num_documents = len(ds)
        self._texts: list[str] | None = None
        self._tokens: list[np.ndarray | None] | None = None
        if cache_key is not None:
            if cache_key not in _BUILTIN_TOKENS:
                _BUILTIN_TOKENS[cache_key] = (list(ds[text_field]), [None] * len(ds))
            self._texts, self._tokens = _BUILTIN_TOKENS[cache_key]
        self._order_epoch, self._order = -1, np.arange(0)

    def order(self, epoch: int) -> np.ndarray:
        if epoch != self._order_epoch:
            if self.shuffle:
                self._order = np.random.default_rng([self.seed, epoch]).permutation(self.num_documents)
            else:
                self._order = np.arange(self.num_documents)
            self._order_epoch = epoch
        return self._order

    def tokens(self, epoch: int, doc: int) -> np.ndarray:
        index = int(self.order(epoch)[doc])
        if self._tokens is not None:
            cached = self._tokens[index]
            if cached is None:
                cached = self._tokens[index] = _encode(self.tokenizer, self._texts[index])
            return cached
        return _encode(self.tokenizer, self.ds[index][self.text_field])


class _StreamDocuments:
    """Documents of an IterableDataset, in order, epoch after epoch; resumable through its
    own state_dict (or by skipping when it has none)."""

    def __init__(self, ds, text_field: str, tokenizer: Tokenizer):
        self.ds, self.text_field, self.tokenizer = ds, text_field, tokenizer
        self._iter = None
        self._epoch, self._doc, self._resume_state = 0, 0, None
        self._loaded_state = False  # whether ds holds a starting state from load_state_dict

    def seek(self, epoch: int, doc: int, hf_state: dict | None) -> None:
        self._iter, self._epoch, self._doc, self._resume_state = None, epoch, doc, hf_state

    def read(self) -> tuple[np.ndarray, int, int, dict | None]:
        """(tokens, epoch, doc index, the dataset's state before this doc) of the next doc."""
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
                    raise ValueError("the streaming dataset has no documents") from None
                self._iter, self._epoch, self._doc = None, self._epoch + 1, 0
                continue
            if self.text_field not in example:
                raise KeyError(f"text_field {self.text_field!r} not in the dataset's examples; "
                               f"keys: {sorted(example)}")
            doc, self._doc = self._doc, self._doc + 1
            return _encode(self.tokenizer, example[self.text_field]), self._epoch, doc, state

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


def _encode(tokenizer: Tokenizer, text: str | None) -> np.ndarray:
    return np.asarray(tokenizer.encode(text or "", bos=True, eos=True), dtype=np.int32)


class _TokenStream:
    """Concatenated document tokens with a resumable read position."""

    def __init__(self, documents: _MapDocuments | _StreamDocuments):
        self.documents = documents
        self.streaming = isinstance(documents, _StreamDocuments)
        self._cur: np.ndarray | None = None
        # Position of the current document (or of the one to load next when _cur is None).
        self.epoch, self.doc, self.offset, self.hf_state = 0, 0, 0, None
        if self.streaming:
            documents.seek(0, 0, None)

    def seek(self, epoch: int, doc: int, offset: int, hf_state: dict | None = None) -> None:
        self._cur = None
        self.epoch, self.doc, self.offset, self.hf_state = epoch, doc, offset, hf_state
        if self.streaming:
            self.documents.seek(epoch, doc, hf_state)

    def _load(self) -> None:
        """Make _cur the document at (epoch, doc), entering it at self.offset."""
        if self.streaming:
            self._cur, self.epoch, self.doc, self.hf_state = self.documents.read()
        else:
            self._cur = self.documents.tokens(self.epoch, self.doc)

    def _advance(self) -> None:
        self._cur, self.offset = None, 0
        if not self.streaming:
            self.doc += 1
            if self.doc == self.documents.num_documents:
                self.epoch, self.doc = self.epoch + 1, 0

    def take(self, n: int) -> np.ndarray:
        pieces, need = [], n
        while need:
            if self._cur is None:
                self._load()
            if self.offset >= len(self._cur):
                self._advance()
                continue
            piece = self._cur[self.offset : self.offset + need]
            pieces.append(piece)
            self.offset += len(piece)
            need -= len(piece)
        return np.concatenate(pieces)


class PackedDataLoader:
    """Iterate to get, per optimizer step, this rank's `grad_accum` micro-batches
    `(inputs_BS, labels_BS)` (int64, CPU). Infinite; `state_dict()` is the stream position."""

    def __init__(self, documents, tokenizer: Tokenizer, seq_len: int, local_batch_size: int,
                 gradient_accumulation_steps: int, dp_rank: int, dp_degree: int, seed: int,
                 description: str = ""):
        for name, value in (("seq_len", seq_len), ("local_batch_size", local_batch_size),
                            ("gradient_accumulation_steps", gradient_accumulation_steps),
                            ("dp_degree", dp_degree)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank must be in [0, {dp_degree}), got {dp_rank}")
        self.tokenizer = tokenizer
        self.seq_len, self.local_batch_size = seq_len, local_batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self.dp_rank, self.dp_degree, self.seed = dp_rank, dp_degree, seed
        self.description = description
        self.global_batch_size = local_batch_size * gradient_accumulation_steps * dp_degree
        self.sequence = 0  # index in the stream of the next global batch's first sequence
        self._stream = _TokenStream(documents)

    def __iter__(self) -> PackedDataLoader:
        return self

    def __next__(self) -> list[MicroBatch]:
        window = self.seq_len + 1
        tokens = self._stream.take(self.global_batch_size * window).reshape(self.global_batch_size, window)
        self.sequence += self.global_batch_size
        rows_per_rank = self.local_batch_size * self.gradient_accumulation_steps
        mine = torch.from_numpy(tokens[self.dp_rank * rows_per_rank : (self.dp_rank + 1) * rows_per_rank]).long()
        micro_batches = []
        for m in range(self.gradient_accumulation_steps):
            rows = mine[m * self.local_batch_size : (m + 1) * self.local_batch_size]
            micro_batches.append((rows[:, :-1].contiguous(), rows[:, 1:].contiguous()))
        return micro_batches

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream (the same on every dp rank); plain ints and dicts."""
        s = self._stream
        state = {"sequence": self.sequence, "epoch": s.epoch, "doc": s.doc, "offset": s.offset,
                 "seed": self.seed, "seq_len": self.seq_len}
        if s.streaming:
            state["hf_state"] = s.hf_state
        else:
            state["num_documents"] = s.documents.num_documents
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue the saved stream; works under another dp degree or batch layout."""
        s = self._stream
        if not s.streaming:
            if state.get("num_documents", s.documents.num_documents) != s.documents.num_documents:
                raise ValueError(f"loader state is for a dataset of {state['num_documents']} documents, "
                                 f"this one has {s.documents.num_documents}")
            if state["seed"] != self.seed:
                raise ValueError(f"loader state was saved with seed {state['seed']}, this loader has "
                                 f"seed {self.seed}: the document order would differ")
        self.sequence = int(state["sequence"])
        s.seek(int(state["epoch"]), int(state["doc"]), int(state["offset"]), state.get("hf_state"))

    def __repr__(self) -> str:
        return (f"PackedDataLoader({self.description}, seq_len={self.seq_len}, "
                f"global_batch={self.global_batch_size}, dp {self.dp_rank}/{self.dp_degree})")


def build_dataloader(dataset: str, dataset_path: str | None, tokenizer: Tokenizer, seq_len: int,
                     local_batch_size: int, gradient_accumulation_steps: int, dp_rank: int,
                     dp_degree: int, seed: int, split: str = "train", streaming: bool = False,
                     text_field: str = "text") -> PackedDataLoader:
    """A packed loader over `dataset` (see `plait.trainer.data.sources` for the names).

    Map-style datasets are shuffled per epoch from `seed` for the train split and read in order
    for other splits; streaming datasets are read in order.
    """
    ds = load_documents(dataset, dataset_path, split=split, streaming=streaming)
    if streaming:
        documents = _StreamDocuments(ds, text_field, tokenizer)
    else:
        cache_key = (split, tokenizer.model_path, tokenizer.n_words) if dataset == "builtin" else None
        documents = _MapDocuments(ds, text_field, tokenizer, seed, shuffle=split == "train", cache_key=cache_key)
    return PackedDataLoader(documents, tokenizer, seq_len, local_batch_size, gradient_accumulation_steps,
                            dp_rank, dp_degree, seed, description=f"{dataset}:{split}")
