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
import time
from typing import Any

# Seconds between checks of `should_stop` while waiting for a batch.
POLL_S = 0.5
# close() waits this long for the batches in flight once a stop was requested (not 300 s: a
# stalled source would hold the stop until the scheduler's kill).
CLOSE_WHEN_STOPPING_S = 5.0


class DataWaitStopped(Exception):
    """A stop was requested (SIGTERM) while the step waited for its batch."""


class PrefetchingLoader:
    def __init__(self, loader, ahead: int = 1, should_stop=None):
        if ahead < 1:
            raise ValueError(f"batches to prepare ahead must be >= 1, got {ahead}")
        self.loader, self.ahead = loader, ahead
        # A SIGTERM handler only sets a flag, and a blocking get() would keep waiting after it ran
        # (a stalled source or a peer's exchange): the wait polls this instead and gives up.
        self.should_stop = should_stop
        self._thread: threading.Thread | None = None
        self._state: dict[str, Any] | None = None  # after the last batch handed out

    def __iter__(self) -> PrefetchingLoader:
        return self

    def __next__(self):
        if self._thread is None:
            self._start()
        self._requests.put(True)  # the one after those in flight, prepared while this step runs
        batch, state, error = self._wait()
        if error is not None:
            self._thread = None  # the worker has exited
            raise error
        self._state = state
        return batch

    def _wait(self):
        while True:
            try:
                return self._results.get(timeout=POLL_S)
            except queue.Empty:
                if self.should_stop is not None and self.should_stop():
                    raise DataWaitStopped("a stop was requested while waiting for the next batch") from None

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
            start = time.monotonic()
            while self._thread.is_alive():
                self._thread.join(timeout=POLL_S)
                stopping = self.should_stop is not None and self.should_stop()
                if time.monotonic() - start > (CLOSE_WHEN_STOPPING_S if stopping else 300):
                    break  # left running as a daemon thread
            self._thread = None

    def state_dict(self) -> dict[str, Any]:
        return self._state if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = None

    def __getattr__(self, name: str):  # encoded_documents, seq_len, ... of the wrapped loader
        return getattr(self.loader, name)
