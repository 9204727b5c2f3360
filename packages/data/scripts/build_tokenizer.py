"""Train the small shipped BPE (`assets/tokenizer.model`) on the built-in corpus.

    python packages/trainer/scripts/build_tokenizer.py [--vocab-size 2048]

Byte-level BPE trained with HF `tokenizers` on the `train` split of the built-in corpus (see
build_corpus.py), pre-tokenised with Llama 3's regex, then exported as tiktoken mergeable ranks:
the 256 single bytes first (rank = byte value, so any text encodes), then the learned merges in
the order they were learned. Llama 3's 256 special tokens come after the ranks, so
`--vocab-size` (2048, the debug model's vocab) = ranks + 256.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

from plait.data import tokenizer as llama3

ASSETS = Path(__file__).resolve().parents[1] / "src" / "plait" / "data" / "assets"


def byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 bytes->unicode map HF's ByteLevel uses to print bytes as chars."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def train_ranks(texts: list[str], num_ranks: int) -> dict[bytes, int]:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(llama3.LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(
        vocab_size=num_ranks,
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    decode = byte_decoder()
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(bpe.to_str())["model"]["merges"]:
        left, right = merge.split(" ") if isinstance(merge, str) else merge
        token = bytes(decode[c] for c in left + right)
        if token not in ranks:
            ranks[token] = len(ranks)
        if len(ranks) == num_ranks:
            break
    return ranks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocab-size", type=int, default=2048, help="ranks + 256 special tokens")
    parser.add_argument("--corpus", type=Path, default=ASSETS / "corpus" / "train.jsonl.gz")
    parser.add_argument("--out", type=Path, default=ASSETS / "tokenizer.model")
    args = parser.parse_args()
    with gzip.open(args.corpus, "rt", encoding="utf-8") as f:
        texts = [json.loads(line)["text"] for line in f]
    ranks = train_ranks(texts, args.vocab_size - llama3.NUM_RESERVED_SPECIAL_TOKENS)
    llama3.write_bpe_ranks(ranks, args.out)
    tok = llama3.Tokenizer(args.out)
    n_bytes = sum(len(t.encode()) for t in texts)
    n_tokens = sum(len(ids) for ids in tok.encode_batch(texts, bos=False, eos=False))
    print(f"{args.out}: {len(ranks)} ranks + {llama3.NUM_RESERVED_SPECIAL_TOKENS} specials = "
          f"n_words {tok.n_words}; corpus {n_bytes / 1e6:.2f} MB -> {n_tokens / 1e6:.2f} M tokens "
          f"({n_bytes / n_tokens:.2f} bytes/token)")


if __name__ == "__main__":
    main()
