"""Prepare the next batches in a background thread while the step runs.

Tokenisers (tiktoken, tokenizers) and the gloo exchange release the GIL, so a thread overlaps the
data work with the step. The thread makes exactly one batch per request, and a request is made per
batch taken (plus `ahead` at the start), so every rank's thread runs the same number of exchange
collectives: none is left waiting for a peer that stopped asking. `state_dict()` is the position
after the last batch handed out, not after the prefetched ones, so resume stays exact.
"""

from __future__ import annotations

import queue
import threading
from typing import Any


class PrefetchingLoader:
    def __init__(self, loader, ahead: int = 1):
        if ahead < 1:
            raise ValueError(f"batches to prepare ahead must be >= 1, got {ahead}")
        self.loader, self.ahead = loader, ahead
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] | None = None  # after the last batch handed out

    def __iter__(self) -> PrefetchingLoader:
        return self

    def __next__(self):
        if self._thread is None:
            self._start()
        self._requests.put(True)  # the one after those in flight, prepared while this step runs
        batch, state, error = self._results.get()
        if error is not None:
            self._thread = None  # the worker has exited
            raise error
        self._state = state
        return batch

    def _start(self) -> None:
        self._requests: queue.Queue = queue.Queue()
        self._results: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._work, name="plait-data-prefetch", daemon=True)
        self._thread.start()
        for _ in range(self.ahead):
            self._requests.put(True)

    def _work(self) -> None:
        while self._requests.get():
            try:
                batch = next(self.loader)
                self._results.put((batch, self.loader.state_dict(), None))
            except BaseException as e:  # handed to the consumer, raised there
                self._results.put((None, None, e))
                return

    def close(self) -> None:
        """Stop the thread after the batches already asked for (so peers' exchanges complete)."""
        if self._thread is not None:
            self._requests.put(False)
            self._thread.join(timeout=300)
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = None

    def __getattr__(self, name: str):  # encoded_documents, seq_len, ... of the wrapped loader
        return getattr(self.loader, name)
