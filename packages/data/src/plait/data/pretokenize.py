"""Tokenise a dataset once into a memory-mapped token folder that `plait-train` reads directly.

    python -m plait.data.pretokenize --dataset json --dataset-path data/*.jsonl \\
        --tokenizer tokenizer.json --output tokens/ --num-proc 16

`datasets.map(num_proc=N)` tokenises in N processes (each document as `<bos> text <eos>`, the
same ids as on the fly); the ids go to `tokens.bin` (np.uint32, documents back to back in dataset
order), `offsets.npy` (int64, document i is tokens[offsets[i]:offsets[i + 1]]) and `meta.json`.
Train on it with `--data.dataset tokens --data.dataset_path tokens/`: each rank memory-maps the
file and reads only its own rows, in the same global order as the on-the-fly path (same seed,
same permutation of the same documents), so the batches are identical.

The folder is written under a temporary name beside `--output` and published by a rename, so an
interrupted run leaves the previous folder (or none), never a half-written one. `meta.json` also
records the largest id written (`max_id`, checked against the run's vocabulary before step 1)
and the tokenizer's identity (`tokenizer_sha256`, its file's hash, compared at load).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np

from .errors import DataError
from .sources import load_documents
from .token_format import META_FILE, OFFSETS_FILE, TOKENS_FILE, tokenizer_sha256
from .tokenizer import build_tokenizer

_TOKENIZERS: dict[str, object] = {}  # one per worker process, built on first use


def _tokenize(batch: dict, text_field: str, tokenizer_path: str | None) -> dict:
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


def check_output(output: Path) -> None:
    """`output` can be (re)published: absent, an empty folder, or an earlier token folder.
    Anything else is the user's and is refused before any tokenising."""
    if output.is_file() or (output.exists() and not output.is_dir()):
        raise ValueError(f"--output {str(output)!r} is an existing file, not a folder: name a new folder")
    if output.is_dir() and any(output.iterdir()) and not (output / META_FILE).is_file():
        raise ValueError(f"--output {str(output)!r} is a non-empty folder that is not a pre-tokenised folder "
                         f"(no {META_FILE}): name a new or empty folder, nothing there is replaced")


def _publish(tmp: Path, output: Path) -> None:
    """Replace `output` by the finished `tmp` folder: the old one moves aside, then is removed.
    Checked again first: the folder may have become someone else's while tokenising."""
    check_output(output)
    old = output.with_name(f".{output.name}.old-{os.getpid()}")
    if output.exists():
        os.replace(output, old)
    os.replace(tmp, output)
    shutil.rmtree(old, ignore_errors=True)


def pretokenize(dataset: str, dataset_path: str | None, output: str | Path, tokenizer_path: str | None = None,
                split: str = "train", text_field: str = "text", num_proc: int = 1) -> dict:
    """Write the token folder; return its meta."""
    output = Path(output)
    check_output(output)
    tok = build_tokenizer(tokenizer_path)
    if tok.n_words > 2**32:
        raise ValueError("token ids must fit np.uint32")
    ds = load_documents(dataset, dataset_path, split=split)
    if text_field not in ds.column_names:
        raise KeyError(f"text_field {text_field!r} is not a column of the dataset; columns: {ds.column_names}")
    ids = ds.map(_tokenize, batched=True, num_proc=num_proc if num_proc > 1 else None,
                 remove_columns=ds.column_names, fn_kwargs={"text_field": text_field, "tokenizer_path": tokenizer_path},
                 desc="tokenizing")
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.with_name(f".{output.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        meta = _write(ids, tmp, tok)
        meta.update(dataset=dataset, dataset_path=dataset_path, split=split, text_field=text_field)
        (tmp / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
        _publish(tmp, output)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return meta


def _write(ids, output: Path, tok) -> dict:
    """tokens.bin and offsets.npy into `output`; the meta that describes them."""
    offsets = np.concatenate([[0], np.cumsum(np.asarray(ids["length"], dtype=np.int64))])
    # A raw .bin (no header): any tool can memory-map it; meta.json says what it holds.
    tokens = np.memmap(output / TOKENS_FILE, dtype=np.uint32, mode="w+", shape=(max(int(offsets[-1]), 1),))
    start, max_id = 0, -1
    for batch in ids.select_columns(["ids"]).with_format("numpy").iter(batch_size=1024):
        flat = np.concatenate(batch["ids"]) if len(batch["ids"]) else np.zeros(0, np.uint32)
        tokens[start : start + len(flat)] = flat
        max_id = max(max_id, int(flat.max())) if len(flat) else max_id
        start += len(flat)
    tokens.flush()
    np.save(output / OFFSETS_FILE, offsets)
    del tokens  # unmapped before the folder is renamed
    return {"num_documents": len(ids), "num_tokens": int(offsets[-1]), "max_id": max_id,
            "tokenizer": tok.model_path, "tokenizer_sha256": tokenizer_sha256(tok),
            "n_words": tok.n_words, "bos_id": tok.bos_id, "eos_id": tok.eos_id}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m plait.data.pretokenize",
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
    except (OSError, ValueError, KeyError) as e:
        print(f"pretokenize: error: {e}", file=sys.stderr)
        return 2
    print(f"pretokenize: {meta['num_documents']} documents, {meta['num_tokens']} tokens -> {ns.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
