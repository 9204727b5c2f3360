"""Data time per step and tokens tokenised per rank: every rank tokenising the whole global batch
(the loader before issue 14) against ranks sharing the tokenising, and the pre-tokenised path.

    python benchmarks/bench_data_sharing.py                     # dp 1, 2, 4 and a simulated dp 64

A fixed global batch (64 sequences of 1024 tokens) over the built-in corpus written out as a
jsonl file (so nothing is cached). dp ranks are threads of one process (`ThreadExchange`); a
rank's data time is its thread's CPU time per step (time.thread_time), which is what the rank
would spend on its own core, whatever the other threads do. The "before" loader is the previous
loader.py, read from git. Medians over the steps after a warm-up step.
"""

import argparse
import gzip
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from plait.data import build_dataloader, build_tokenizer
from plait.data.exchange import ThreadExchange
from plait.data.pretokenize import pretokenize
from plait.data.sources import builtin_corpus_files

BEFORE_COMMIT = "a963098"  # the loader before issue 14
SEQ, GLOBAL = 1024, 64


def _old_loader_module(tmp: Path):
    """The previous loader.py, importable next to today's sources/tokenizer modules."""
    root = Path(__file__).resolve().parents[1]
    text = subprocess.run(["git", "-C", str(root), "show",
                           f"{BEFORE_COMMIT}:packages/trainer/src/plait/trainer/data/loader.py"],
                          capture_output=True, text=True, check=True).stdout
    path = tmp / "old_loader.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("plait.data._old_loader", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _timed_steps(loader, steps):
    times = []
    for _ in range(steps + 1):
        t0 = time.thread_time()
        next(loader)
        times.append(time.thread_time() - t0)
    return statistics.median(times[1:])


def before(old, corpus, tok, dp, steps):
    """Rank 0 of dp: the old loader tokenises the whole global batch (every rank the same work)."""
    old._BUILTIN_TOKENS.clear()
    ld = old.build_dataloader("json", corpus, tok, SEQ, GLOBAL // dp, 1, 0, dp, 0)
    counted = _Counting(tok)
    ld.tokenizer = counted
    ld._stream.documents.tokenizer = counted
    t = _timed_steps(ld, steps)
    return t, counted.tokens / (steps + 1)


def after(corpus, tok, dp, steps, dataset="json"):
    """dp threaded ranks sharing the tokenising; the slowest rank's median step and its tokens."""
    exchanges, out = ThreadExchange.group(dp), [None] * dp

    def rank(r):
        ld = build_dataloader(dataset, corpus, tok, SEQ, GLOBAL // dp, 1, r, dp, 0, exchange=exchanges[r])
        out[r] = (_timed_steps(ld, steps), ld.encoded_tokens / (steps + 1),
                  getattr(ld.documents, "tokens_read", 0) / (steps + 1))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return max(o[0] for o in out), max(o[1] for o in out), max(o[2] for o in out)


class _Counting:
    """The tokenizer, counting the tokens it produces."""

    def __init__(self, tok):
        self.tok, self.tokens = tok, 0

    def encode(self, *a, **k):
        ids = self.tok.encode(*a, **k)
        self.tokens += len(ids)
        return ids

    def __getattr__(self, name):
        return getattr(self.tok, name)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", default="1,2,4,64")
    parser.add_argument("--steps", type=int, default=4)
    ns = parser.parse_args()
    tok = build_tokenizer(None)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        corpus = tmp / "train.jsonl"
        with gzip.open(builtin_corpus_files()["train"], "rt") as f:
            corpus.write_text(f.read())
        pretokenize("json", str(corpus), tmp / "tokens", num_proc=2)
        old = _old_loader_module(tmp)
        print(f"global batch {GLOBAL} x {SEQ} tokens; per rank per step (medians of {ns.steps} steps)")
        print("| dp | before: data ms | before: tokens tokenised | after: data ms | after: tokens tokenised "
              "| pre-tokenised: data ms | pre-tokenised: tokens read |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        for dp in [int(x) for x in ns.dp.split(",")]:
            b_time, b_tokens = before(old, str(corpus), tok, dp, ns.steps)
            a_time, a_tokens, _ = after(str(corpus), tok, dp, ns.steps)
            p_time, _, p_read = after(str(tmp / "tokens"), tok, dp, ns.steps, dataset="tokens")
            print(f"| {dp} | {b_time * 1e3:.1f} | {b_tokens:,.0f} | {a_time * 1e3:.1f} | {a_tokens:,.0f} "
                  f"| {p_time * 1e3:.2f} | {p_read:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
