"""Prefetch in a background thread: the same batches, taking one is ~free while the next is
prepared, the state is the position after the batches handed out (exact resume), and threaded
ranks sharing the tokenising stay in step through their exchanges."""

import json
import threading
import time

import pytest
import torch

from plait.data import build_dataloader, build_tokenizer
from plait.data.exchange import ThreadExchange
from plait.data.prefetch import PrefetchingLoader

SEQ = 64


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("prefetch") / "train.jsonl"
    docs = [f"Document {i}: " + "Although never is often better than right now. " * (3 + i % 17) for i in range(200)]
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    return str(path)


def make(corpus, rank=0, degree=1, exchange=None):
    return build_dataloader("json", corpus, build_tokenizer(None), SEQ, 8 // degree, 1, rank, degree, 0,
                            exchange=exchange)


def rows(step):
    """The step's (one) micro-batch as [rows, 2 * SEQ]: inputs, then document positions."""
    (x, _, p), = step
    return torch.cat([x, p.long()], dim=1)


def test_same_batches_and_exact_resume(corpus):
    plain = make(corpus)
    expected = [rows(next(plain)) for _ in range(8)]
    ahead = PrefetchingLoader(make(corpus), ahead=2)
    assert ahead.state_dict() == make(corpus).state_dict()  # before the first batch: the start
    got = [rows(next(ahead)) for _ in range(4)]
    state = ahead.state_dict()  # after 4 batches, though the thread has prepared more
    resumed = PrefetchingLoader(make(corpus))
    resumed.load_state_dict(json.loads(json.dumps(state)))
    got += [rows(next(resumed)) for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
    # load_state_dict on a running prefetcher stops its thread and restarts from the state.
    ahead.load_state_dict(state)
    assert torch.equal(rows(next(ahead)), expected[4])
    ahead.close()
    resumed.close()


def test_taking_a_prepared_batch_is_free(corpus):
    ld = PrefetchingLoader(make(corpus))
    next(ld)
    time.sleep(0.5)  # "the step": the next batch is prepared meanwhile
    t0 = time.perf_counter()
    next(ld)
    assert time.perf_counter() - t0 < 0.05
    ld.close()


def test_threaded_ranks_with_exchange_close_cleanly(corpus):
    expected = [rows(next(ld)) for ld in [make(corpus)] for _ in range(5)]
    exchanges, out = ThreadExchange.group(2), [None, None]

    def rank(r):
        ld = PrefetchingLoader(make(corpus, r, 2, exchanges[r]), ahead=2)
        out[r] = [rows(next(ld)) for _ in range(5)]
        ld.close()  # joins: the prefetched exchanges were asked for by both ranks

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert all(torch.equal(torch.cat([out[0][k], out[1][k]]), expected[k]) for k in range(5))


class _Stalling:
    """A loader whose batches stop coming after `good` (a stalled source or exchange)."""

    def __init__(self, loader, good: int):
        self.loader, self.good = loader, good
        self.stalled, self.release = threading.Event(), threading.Event()

    def __next__(self):
        if self.good == 0:
            self.stalled.set()
            self.release.wait(120)
        self.good -= 1
        return next(self.loader)

    def state_dict(self):
        return self.loader.state_dict()


def test_a_stop_request_ends_the_wait_for_a_stalled_batch(corpus):
    from plait.data.prefetch import POLL_S, DataWaitStopped

    stop = threading.Event()
    src = _Stalling(make(corpus), good=1)
    ld = PrefetchingLoader(src, should_stop=stop.is_set)
    next(ld)
    threading.Timer(0.3, stop.set).start()
    t0 = time.perf_counter()
    with pytest.raises(DataWaitStopped):
        next(ld)
    assert src.stalled.is_set() and time.perf_counter() - t0 < 0.3 + 2 * POLL_S + 1
    src.release.set()


# at_step 2: SIGTERM while step 2 runs (usually the ordinary stop, whose close() must not wait for
# the stalled thread); at_step 3: while step 3 waits for its batch.
@pytest.mark.parametrize("at_step", [2, 3])
def test_sigterm_while_the_batch_stalls_stops_the_run_unfinished(tmp_path, capsys, at_step):
    import os
    import signal

    from plait.trainer.config import build_config
    from plait.trainer.train import Trainer

    trainer = Trainer(build_config({
        "job": {"dump_folder": str(tmp_path)},
        "training": {"steps": 6, "seq_len": 32, "local_batch_size": 2},
        "metrics": {"log_freq": 1, "cpu_peak_tflops": 0.1},
    }))
    src = trainer.loader.loader = _Stalling(trainer.loader.loader, good=2)
    # The prefetch thread asks for batch 3 while step 2 runs; the main thread waits for it at step 3.
    def terminate():
        src.stalled.wait(60)
        while trainer.step < at_step:  # the loop counts the step before it waits for the batch
            time.sleep(0.001)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate, daemon=True).start()
    t0 = time.perf_counter()
    assert trainer.train() is False  # unfinished: plait-train exits 75 (preempted)
    elapsed = time.perf_counter() - t0
    src.release.set()
    assert trainer.step == 2 and elapsed < 60  # not the stalled source's 120 s
    out = capsys.readouterr().out
    assert "SIGTERM while waiting for data, stopped after step 2" in out if at_step == 3 else "stopped after step 2" in out
