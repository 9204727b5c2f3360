"""Attention work imbalance per cp rank under document masking, per sharding strategy.

    python packages/contextparallel/benchmarks/document_imbalance.py [--micro-batches 32] [--seed 0]

Work = query-key pairs actually computed (FLOPs-proportional), per rank, from
`plait.contextparallel.attention_work`: our head-tail chunks in 1, 2 and 4 rounds
(`SequenceLayout(cp, rounds=k)`: 2 x cp x k chunks, head-tail per round; the plans the kernels
run), contiguous chunks, and torchtitan's per-document head-tail (each document cut into 2 x cp
pieces, simulated). A micro-batch is B rows (B = 1, as long-context runs use, and B = 8); its
work per rank is summed over its rows, its imbalance is max/mean over ranks; a cell is the mean
over micro-batches, with the worst micro-batch in brackets. "doc/causal" is document work over
causal work (1 - the fraction of attention FLOPs document masking skips). Ulysses computes the
whole sequence on heads / cp on every rank: always 1.00. Causal work is exactly balanced by
head-tail for any rounds.

Mixes (document lengths in tokens):
  short     log-normal, median 300, sigma 0.6 (every document short relative to a chunk at long seq)
  one-long  per row one document of 60% of the row at a random offset, short documents around it
  web       log-normal, median 600, sigma 1.4 (heavy tail: mean ~1600, 1% > 15k tokens)
Rows are cut from a stream of documents, so a row starts mid-document (one-long: built per row).
"""

import argparse
import math
import random
import statistics

from plait.contextparallel import PerDocumentHeadTail, SequenceLayout, attention_work, imbalance

MIXES = {"short": (300, 0.6), "web": (600, 1.4)}


def _lognormal(rng: random.Random, median: float, sigma: float) -> int:
    return max(1, round(rng.lognormvariate(math.log(median), sigma)))


def stream_rows(rng: random.Random, median: float, sigma: float, seq_len: int, n_rows: int) -> list[list[int]]:
    """Segment lengths of rows cut from one stream of documents (rows start mid-document)."""
    rows, row, left = [], [], _lognormal(rng, median, sigma)
    rng_skip = rng.randrange(left)  # the stream starts at a random point of its first document
    left -= rng_skip
    while len(rows) < n_rows:
        take = min(left, seq_len - sum(row))
        row.append(take)
        left -= take
        if left == 0:
            left = _lognormal(rng, median, sigma)
        if sum(row) == seq_len:
            rows.append(row)
            row = []
    return rows


def one_long_rows(rng: random.Random, seq_len: int, n_rows: int) -> list[list[int]]:
    rows = []
    for _ in range(n_rows):
        long = int(0.6 * seq_len)
        before = rng.randrange(seq_len - long + 1)
        row = _fill(rng, before) + [long] + _fill(rng, seq_len - long - before)
        rows.append(row)
    return rows


def _fill(rng: random.Random, n: int) -> list[int]:
    out = []
    while sum(out) < n:
        out.append(min(_lognormal(rng, *MIXES["short"]), n - sum(out)))
    return out


ROUNDS = (1, 2, 4)


def table(n_micro_batches: int, seed: int, batch_sizes=(1, 8), seq_lens=(4096, 16384), cps=(2, 4, 8)) -> list[str]:
    rounds_heads = " | ".join(f"head-tail k={k}" for k in ROUNDS)
    lines = [
        f"| mix | seq | cp | B | {rounds_heads} | contiguous | per-document head-tail | doc/causal |",
        "|---|---|---|---|" + "---|" * (len(ROUNDS) + 3),
    ]
    for mix in ("short", "one-long", "web"):
        for seq_len in seq_lens:
            for B in batch_sizes:
                rng = random.Random(f"{seed}-{mix}-{seq_len}-{B}")
                n_rows = n_micro_batches * B
                if mix == "one-long":
                    rows = one_long_rows(rng, seq_len, n_rows)
                else:
                    rows = stream_rows(rng, *MIXES[mix], seq_len, n_rows)
                batches = [rows[i : i + B] for i in range(0, n_rows, B)]
                for cp in cps:
                    strategies = [SequenceLayout(cp, True, k) for k in ROUNDS]
                    strategies += [SequenceLayout(cp, False), PerDocumentHeadTail(cp)]
                    cells = []
                    for strategy in strategies:
                        ratios = [imbalance(attention_work(strategy, batch, seq_len)) for batch in batches]
                        cells.append(f"{statistics.mean(ratios):.3f} ({max(ratios):.2f})")
                    doc = sum(sum(attention_work(SequenceLayout(cp, True), [row], seq_len)) for row in rows)
                    causal = len(rows) * seq_len * (seq_len + 1) // 2
                    lines.append(f"| {mix} | {seq_len} | {cp} | {B} | " + " | ".join(cells) + f" | {doc / causal:.3f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--micro-batches", type=int, default=32, help="micro-batches per mix, seq and batch size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print("max/mean attention work per cp rank: mean over micro-batches (worst); Ulysses: 1.00 always")
    print("\n".join(table(args.micro_batches, args.seed)))


if __name__ == "__main__":
    main()
