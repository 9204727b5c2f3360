"""How the ranks that load data share the work of tokenising it.

The loader needs two collectives per step: an all-gather of small Python objects (document
lengths, the token range each rank wants) and an all-to-all of token arrays (each rank sends the
pieces of the documents it tokenised to the ranks whose rows hold them). Three implementations:

  * `SoloExchange`        one rank alone (dp 1, or a unit test building one rank's loader);
  * `DistributedExchange` real ranks, over a dedicated gloo group (CPU tensors; the group is the
                          data's own so a prefetch thread never interleaves with training);
  * `ThreadExchange`      N ranks as threads of one process (tests, and benchmarks that simulate
                          many dp ranks without starting processes).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch


class SoloExchange:
    """One rank: both collectives return what they were given."""

    rank, size = 0, 1

    def all_gather(self, obj: Any) -> list[Any]:
        return [obj]

    def all_to_all(self, sends: list[np.ndarray], recv_sizes: list[int]) -> list[np.ndarray]:
        return list(sends)


class DistributedExchange:
    """Over a torch.distributed group (gloo: tokens are host data)."""

    def __init__(self, group=None):
        import torch.distributed as dist

        self._dist, self.group = dist, group
        self.rank, self.size = dist.get_rank(group), dist.get_world_size(group)

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.size
        self._dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_to_all(self, sends: list[np.ndarray], recv_sizes: list[int]) -> list[np.ndarray]:
        # The receiver knows what it gets from each rank (the document layout is global), so one
        # all_to_all_single with split sizes moves everything; no size exchange first.
        send = torch.from_numpy(np.concatenate(sends).astype(np.int32, copy=False))
        recv = torch.empty(sum(recv_sizes), dtype=torch.int32)
        self._dist.all_to_all_single(recv, send, recv_sizes, [len(s) for s in sends], group=self.group)
        return list(np.split(recv.numpy(), np.cumsum(recv_sizes)[:-1]))


class ThreadExchange:
    """`size` ranks as threads of one process: `ThreadExchange.group(n)` gives one per rank."""

    def __init__(self, rank: int, shared: _ThreadShared):
        self.rank, self.size, self._shared = rank, shared.size, shared

    @staticmethod
    def group(size: int) -> list[ThreadExchange]:
        shared = _ThreadShared(size)
        return [ThreadExchange(r, shared) for r in range(size)]

    def all_gather(self, obj: Any) -> list[Any]:
        return self._shared.exchange(self.rank, obj)

    def all_to_all(self, sends: list[np.ndarray], recv_sizes: list[int]) -> list[np.ndarray]:
        every = self._shared.exchange(self.rank, sends)
        received = [every[src][self.rank] for src in range(self.size)]
        assert [len(r) for r in received] == recv_sizes
        return received


class _ThreadShared:
    def __init__(self, size: int):
        self.size = size
        self._slots: list[Any] = [None] * size
        self._barrier = threading.Barrier(size, timeout=60)

    def exchange(self, rank: int, obj: Any) -> list[Any]:
        self._slots[rank] = obj
        self._barrier.wait()  # everyone wrote
        out = list(self._slots)
        self._barrier.wait()  # everyone read before the next exchange overwrites
        return out
