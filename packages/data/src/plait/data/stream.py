"""The global token stream, tokenised once across the ranks and read by each rank for its rows.

The stream is documents in order (see `documents.py`), each `<bos> text <eos>`, concatenated. Its
layout — where each document starts — depends on every earlier document's length, so a rank
cannot find its rows alone. Here the ranks split the work: document g (counted from the last
seek) is tokenised by rank g % R only, the R ranks all-gather the lengths (a few ints), and then
one all-to-all sends every rank exactly the token pieces of its own rows. A rank so tokenises
1/R of the documents and receives only the tokens it trains on, and every rank knows the same
layout, so the position (and the checkpointed state) is the same on all of them.

`take` also returns each token's offset inside its document (0 at its `<bos>`), from the same
layout: no rank needs another's tokens for it, and a range that starts mid-document continues
that document's count, after a seek too (the position holds the offset into the document).
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np

from .documents import Document
from .errors import DataError
from .exchange import SoloExchange

# Documents of a stream (no known size) read without a single non-empty text before giving up.
EMPTY_STREAM_LIMIT = 10_000


class SharedTokenStream:
    def __init__(self, documents, exchange):
        self.documents, self.exchange = documents, exchange
        # Streaming split by node: rank r reads only its documents (its split_dataset_by_node stream).
        self.split = getattr(documents, "split", None) is not None
        self.encoded_documents = 0  # documents this rank tokenised (for tests and benchmarks)
        self.encoded_tokens = 0
        self._tokens_seen = self._docs_seen = 0  # global, for sizing the next round
        self._texts_seen = 0  # documents with a token between their <|begin_of_text|> and <|end_of_text|>
        self.seek(0, 0, 0, None)

    def seek(self, epoch: int, doc: int, offset: int, hf_state: dict | None = None) -> None:
        """Continue at token `offset` of document (epoch, doc); every rank seeks together."""
        self.documents.seek(epoch, doc, hf_state)
        self._docs: deque[Document] = deque()  # read documents, the current one first
        self._resolved = 0  # how many of _docs have their (global) length known
        self._first = 0  # number of _docs[0] since the seek: its owner is _first % size
        self._resolved_tokens = 0  # sum of the resolved documents' lengths
        self.offset = offset
        self._seek_states = [[epoch, doc, hf_state]] * self.exchange.size  # split by node, before reading

    def position(self) -> tuple[int, int, int, dict | None]:
        """(epoch, doc, offset, hf_state) of the next token."""
        if not self._docs:
            self._docs.append(self.documents.read())  # only reads: lengths are resolved together
        d = self._docs[0]
        return d.epoch, d.doc, self.offset, d.hf_state

    def take(self, total: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [lo, hi) of the next `total` tokens (this rank's rows) and their document
        positions (int32), then move past all `total`. Every rank calls it with the same `total`."""
        self._resolve(total)
        ex = self.exchange
        requests = ex.all_gather((lo, hi)) if ex.size > 1 else [(lo, hi)]
        spans = self._spans(total)
        sends = []
        for a, b in requests:
            pieces = [d.tokens[max(a, s) - s : min(b, e) - s] for i, d, s, e in spans
                      if self._owner(i) == ex.rank and s < b and e > a]
            sends.append(np.concatenate(pieces) if pieces else np.zeros(0, np.int32))
        recv_sizes = [0] * ex.size
        for i, _, s, e in spans:
            recv_sizes[self._owner(i)] += max(0, min(hi, e) - max(lo, s))
        received = ex.all_to_all(sends, recv_sizes)
        cursor = [0] * ex.size
        out = []
        for i, _, s, e in spans:
            n = min(hi, e) - max(lo, s)
            if n > 0:
                src = self._owner(i)
                out.append(received[src][cursor[src] : cursor[src] + n])
                cursor[src] += n
        positions = document_positions(spans, lo, hi)
        self._consume(total)
        if self.split and self._resolved < ex.size:
            # Keep a resolved document of every rank ahead, so the state (each rank's stream
            # position) is known everywhere without a collective of its own.
            self._round(ex.size - self._resolved)
        return (np.concatenate(out) if out else np.zeros(0, np.int32)), positions

    def split_state(self) -> dict:
        """Split by node: where each rank's stream stands, and whose document is current."""
        ex = self.exchange
        if self._resolved < ex.size:  # only before the first batch: nothing read yet
            return {"phase": self._first % ex.size, "ranks": self._seek_states}
        ranks = [None] * ex.size
        for i in range(ex.size):
            d = self._docs[i]
            ranks[self._owner(i)] = [d.epoch, d.doc, d.hf_state]
        return {"phase": self._first % ex.size, "ranks": ranks}

    def seek_split(self, phase: int, ranks: list, offset: int) -> None:
        ex = self.exchange
        if len(ranks) != ex.size:
            raise ValueError(f"a streaming dataset split by node resumes on the same number of ranks: "
                             f"the state has {len(ranks)}, this run {ex.size}")
        epoch, doc, hf_state = ranks[ex.rank]
        self.seek(epoch, doc, offset, hf_state)
        self._first, self._seek_states = phase, ranks

    def _owner(self, i: int) -> int:
        return (self._first + i) % self.exchange.size

    def _available(self) -> int:
        return self._resolved_tokens - self.offset

    def _resolve(self, need: int) -> None:
        """Read and tokenise (each rank its share) until the known lengths cover `need` tokens."""
        while (available := self._available()) < need:
            # Size the round from what all ranks know, so they agree on it without talking.
            mean = self._tokens_seen / self._docs_seen if self._docs_seen else 512
            self._round(max(1, math.ceil((need - available) / mean * 1.1)))

    def _round(self, count: int) -> None:
        """Resolve the next `count` documents: each rank tokenises its own, all learn the lengths."""
        ex, split = self.exchange, self.split
        target = self._resolved + count
        while len(self._docs) < target:
            # Split by node, a rank reads only its own documents; the others' are placeholders
            # filled from their owners' replies.
            owned = not split or self._owner(len(self._docs)) == ex.rank
            self._docs.append(self.documents.read() if owned else Document(-1, -1))
        mine = [i for i in range(self._resolved, target) if self._owner(i) == ex.rank]
        error = None
        try:
            for i in mine:
                d = self._docs[i]
                d.tokens, encoded = self.documents.tokens(d)
                self.encoded_documents += encoded
                self.encoded_tokens += len(d.tokens) if encoded else 0
        except DataError as e:  # a bad row: every rank must stop with it, none left waiting
            error = str(e)
        where = [(self._docs[i].epoch, self._docs[i].doc, self._docs[i].hf_state) for i in mine] if split else None
        reply = ([] if error else [len(self._docs[i].tokens) for i in mine], error, where)
        replies = ex.all_gather(reply) if ex.size > 1 else [reply]
        errors = [e for _, e, _ in replies if e]
        if errors:
            raise DataError(errors[0])
        taken = [0] * ex.size
        for i in range(self._resolved, target):
            owner, d = self._owner(i), self._docs[i]
            d.length = replies[owner][0][taken[owner]]
            if split:  # every rank learns where each rank's stream stands
                d.epoch, d.doc, d.hf_state = replies[owner][2][taken[owner]]
            taken[owner] += 1
            self._tokens_seen += d.length
            self._resolved_tokens += d.length
            self._texts_seen += d.length > 2
        self._docs_seen += count
        self._resolved = target
        self._refuse_empty_texts()

    def _refuse_empty_texts(self) -> None:
        """A corpus whose every text is empty would train on <|begin_of_text|><|end_of_text|> pairs
        alone: after a whole epoch of them (or 10,000 of a stream) stop, on every rank at once (all
        know every length)."""
        limit = getattr(self.documents, "num_documents", None) or EMPTY_STREAM_LIMIT
        if self._texts_seen == 0 and self._docs_seen >= limit:
            name = getattr(self.documents, "name", "the dataset")
            raise DataError(f"{name}: every text of its first {self._docs_seen} documents is empty: it would train "
                            "on <|begin_of_text|><|end_of_text|> pairs alone; check data.text_field or the dataset")

    def _spans(self, total: int) -> list[tuple[int, Document, int, int]]:
        """(index, document, start, end) of the resolved documents overlapping [0, total),
        positions relative to the next token."""
        spans, start = [], -self.offset
        for i in range(self._resolved):
            d = self._docs[i]
            if start >= total:
                break
            if start + d.length > 0:
                spans.append((i, d, start, start + d.length))
            start += d.length
        return spans

    def _consume(self, total: int) -> None:
        end = self.offset + total  # in coordinates of _docs[0]'s start
        while self._resolved and self._docs[0].length <= end:
            end -= self._docs[0].length
            self._resolved_tokens -= self._docs[0].length
            self._docs.popleft()
            self._resolved -= 1
            self._first += 1
        self.offset = end


class IndexedTokenStream(SharedTokenStream):
    """The same stream over documents whose lengths are known up front (a pre-tokenised folder):
    every rank lays out the stream alone, from the offsets, and reads only the token ranges of its
    own rows. No tokenising, no collective."""

    def __init__(self, documents):
        super().__init__(documents, SoloExchange())

    def take(self, total: int, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        self._resolve(total)
        spans = self._spans(total)
        out = [self.documents.slice(d, max(lo, s) - s, min(hi, e) - s) for _, d, s, e in spans if s < hi and e > lo]
        positions = document_positions(spans, lo, hi)
        self._consume(total)
        return (np.concatenate(out) if out else np.zeros(0, np.int32)), positions

    def _resolve(self, need: int) -> None:
        empty_run = 0  # documents in a row without a token: a whole epoch of them would loop forever
        while self._available() < need:
            d = self.documents.read() if len(self._docs) == self._resolved else self._docs[self._resolved]
            if len(self._docs) == self._resolved:
                self._docs.append(d)
            d.length = self.documents.length(d)
            empty_run = 0 if d.length else empty_run + 1
            if empty_run > self.documents.num_documents:
                raise DataError(f"{self.documents.name}: every document is empty (0 tokens): nothing to train on")
            self._resolved_tokens += d.length
            self._resolved += 1


def document_positions(spans: list[tuple[int, Document, int, int]], lo: int, hi: int) -> np.ndarray:
    """Each token of [lo, hi)'s offset inside its document (int32). `spans` (index, document,
    start, end) tile the range in the same coordinates: one arange over the range, shifted back
    by each token's document start (repeated per document, no loop over tokens). Counted from
    `lo`, everything fits int32 (a rank's rows of one step; a document's length)."""
    bounds = np.array([(s, e) for _, _, s, e in spans if s < hi and e > lo], np.int64).reshape(-1, 2) - lo
    counts = np.minimum(bounds[:, 1], hi - lo) - np.maximum(bounds[:, 0], 0)
    return np.arange(hi - lo, dtype=np.int32) - np.repeat(bounds[:, 0].astype(np.int32), counts)
