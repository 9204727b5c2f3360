"""Tokenise a dataset once into a memory-mapped token folder that `plait-train` reads directly.

    python -m plait.trainer.data.pretokenize --dataset json --dataset-path data/*.jsonl \\
        --tokenizer tokenizer.json --output tokens/ --num-proc 16

`datasets.map(num_proc=N)` tokenises in N processes (each document as `<bos> text <eos>`, the
same ids as on the fly); the ids go to `tokens.bin` (np.uint32, documents back to back in dataset
order), `offsets.npy` (int64, document i is tokens[offsets[i]:offsets[i + 1]]) and `meta.json`.
Train on it with `--data.dataset tokens --data.dataset_path tokens/`: each rank memory-maps the
file and reads only its own rows, in the same global order as the on-the-fly path (same seed,
same permutation of the same documents), so the batches are identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

TOKENS_FILE, OFFSETS_FILE, META_FILE = "tokens.bin", "offsets.npy", "meta.json"
_TOKENIZERS: dict[str, object] = {}  # one per worker process, built on first use


def _tokenize(batch: dict, text_field: str, tokenizer_path: str | None) -> dict:
    from .sources import DataError
    from .tokenizer import build_tokenizer

    key = tokenizer_path or ""
    if key not in _TOKENIZERS:
        _TOKENIZERS[key] = build_tokenizer(tokenizer_path)
    tok = _TOKENIZERS[key]
    texts = batch[text_field]
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
    if bad is not None:
        raise DataError(f"a row has {type(texts[bad]).__name__} text {str(texts[bad])[:40]!r}: every row needs a "
                        "string in the text field; remove or fix it")
    ids = tok.encode_batch(texts, bos=True, eos=True)
    return {"ids": ids, "length": [len(x) for x in ids]}


def pretokenize(dataset: str, dataset_path: str | None, output: str | Path, tokenizer_path: str | None = None,
                split: str = "train", text_field: str = "text", num_proc: int = 1) -> dict:
    """Write the token folder; return its meta."""
    from .sources import load_documents
    from .tokenizer import build_tokenizer

    tok = build_tokenizer(tokenizer_path)
    if tok.n_words > 2**32:
        raise ValueError("token ids must fit np.uint32")
    ds = load_documents(dataset, dataset_path, split=split)
    if text_field not in ds.column_names:
        raise KeyError(f"text_field {text_field!r} is not a column of the dataset; columns: {ds.column_names}")
    ids = ds.map(_tokenize, batched=True, num_proc=num_proc if num_proc > 1 else None,
                 remove_columns=ds.column_names, fn_kwargs={"text_field": text_field, "tokenizer_path": tokenizer_path},
                 desc="tokenizing")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(ids["length"], dtype=np.int64))])
    # A raw .bin (no header): any tool can memory-map it; meta.json says what it holds.
    tokens = np.memmap(output / TOKENS_FILE, dtype=np.uint32, mode="w+", shape=(max(int(offsets[-1]), 1),))
    start = 0
    for batch in ids.select_columns(["ids"]).with_format("numpy").iter(batch_size=1024):
        flat = np.concatenate(batch["ids"]) if len(batch["ids"]) else np.zeros(0, np.uint32)
        tokens[start : start + len(flat)] = flat
        start += len(flat)
    tokens.flush()
    np.save(output / OFFSETS_FILE, offsets)
    meta = {"num_documents": len(ids), "num_tokens": int(offsets[-1]), "dataset": dataset,
            "dataset_path": dataset_path, "split": split, "text_field": text_field,
            "tokenizer": tok.model_path, "n_words": tok.n_words, "bos_id": tok.bos_id, "eos_id": tok.eos_id}
    (output / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.trainer.data.pretokenize",
                                     description="Tokenise a dataset once into memory-mapped token files.")
    parser.add_argument("--dataset", required=True, help="as data.dataset: builtin, json, parquet, a path, ...")
    parser.add_argument("--dataset-path", default=None)
    parser.add_argument("--split", default="train")
    parser.add_argument("--text-field", default="text")
    parser.add_argument("--tokenizer", default=None, help="tokenizer.json or tokenizer.model (default: shipped)")
    parser.add_argument("--output", required=True, help="folder to write tokens.bin, offsets.npy, meta.json")
    parser.add_argument("--num-proc", type=int, default=1, help="tokenising processes (datasets.map num_proc)")
    ns = parser.parse_args(argv)
    try:
        meta = pretokenize(ns.dataset, ns.dataset_path, ns.output, ns.tokenizer, ns.split, ns.text_field, ns.num_proc)
    except (FileNotFoundError, ValueError, KeyError) as e:
        print(f"pretokenize: error: {e}", file=sys.stderr)
        return 2
    print(f"pretokenize: {meta['num_documents']} documents, {meta['num_tokens']} tokens -> {ns.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
