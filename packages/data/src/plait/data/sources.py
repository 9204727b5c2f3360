"""Where documents come from: every source goes through `datasets.load_dataset`.

`dataset` names one of:
  * "builtin"                    the offline corpus shipped in `assets/corpus/` (stdlib docs);
  * "json" | "parquet" | "text" | "csv" | "arrow"
                                 local files at `dataset_path` (a file, a glob or a directory);
  * "auto" (or "")               local files at `dataset_path`, builder inferred from the extension;
  * a local path                 same as "auto" with that path;
  * "c4" | "fineweb" | "fineweb-edu"
                                 hub aliases (allenai/c4 "en", HuggingFaceFW/fineweb(-edu)
                                 "sample-10BT"); `dataset_path` may point at a local copy;
  * "tokens"                     a folder written by `pretokenize.py` at `dataset_path` (memory-mapped);
  * "owner/name" or "owner/name:config"
                                 any hub dataset; `dataset_path` may point at a local copy.
Hub datasets are meant to be read with `streaming=True`.
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import datasets

from .errors import DataError, read_error
from .token_format import read_meta

LOCAL_BUILDERS = ("json", "parquet", "text", "csv", "arrow")
TOKENS = "tokens"  # a pre-tokenised folder (pretokenize.py), read without `datasets`
_EXTENSION_BUILDERS = {
    ".json": "json", ".jsonl": "json", ".ndjson": "json",
    ".parquet": "parquet",
    ".txt": "text", ".text": "text", ".md": "text",
    ".csv": "csv",
    ".arrow": "arrow",
}
_COMPRESSIONS = (".gz", ".bz2", ".xz", ".zst", ".lz4", ".zip")
HUB_ALIASES = {
    "c4": ("allenai/c4", "en"),
    "fineweb": ("HuggingFaceFW/fineweb", "sample-10BT"),
    "fineweb-edu": ("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}


def builtin_corpus_files() -> dict[str, str]:
    corpus = resources.files("plait.data") / "assets" / "corpus"
    return {split: str(corpus / f"{split}.jsonl.gz") for split in ("train", "validation")}


def infer_builder(path: str) -> str:
    """The `datasets` packaged builder for a file, glob or directory, from file extensions."""
    p = Path(path)
    names = [p.name] if not p.is_dir() else sorted(f.name for f in p.rglob("*") if f.is_file())
    for name in names:
        for comp in _COMPRESSIONS:
            name = name.removesuffix(comp)
        builder = _EXTENSION_BUILDERS.get(os.path.splitext(name)[1].lower())
        if builder:
            return builder
    raise ValueError(f"cannot infer the dataset format of {path!r}: expected files ending in "
                     f"{sorted(_EXTENSION_BUILDERS)}; or set dataset to one of {LOCAL_BUILDERS}")


def _check_local(path: str) -> None:
    if not os.path.isdir(path) and not any(ch in path for ch in "*?[") and not os.path.exists(path):
        raise FileNotFoundError(f"dataset_path not found: {path!r}")


def resolve_source(dataset: str, dataset_path: str | None, split: str = "train") -> tuple[str, dict]:
    """(builder or hub repo, `datasets.load_dataset` keyword arguments) for a source, checking
    everything that can be checked without reading it: validation calls this before the model is
    built, so a missing file or a malformed name fails at once."""
    if dataset == TOKENS:
        if not dataset_path:
            raise ValueError("dataset 'tokens' reads a pre-tokenised folder: set dataset_path to it")
        if not os.path.isdir(dataset_path):
            raise FileNotFoundError(f"dataset_path not found: {dataset_path!r} (a pre-tokenised folder)")
        return TOKENS, {"folder": dataset_path}
    if dataset == "builtin":
        if dataset_path:
            raise ValueError("dataset 'builtin' is shipped with plait; it takes no dataset_path")
        files = builtin_corpus_files()
        if split not in files:
            raise ValueError(f"the builtin corpus has splits {sorted(files)}, not {split!r}")
        return "json", {"data_files": {split: files[split]}}
    if dataset in LOCAL_BUILDERS or dataset in ("", "auto") or os.path.exists(dataset):
        path = dataset_path if dataset in LOCAL_BUILDERS or dataset in ("", "auto") else dataset
        if not path:
            raise ValueError(f"dataset {dataset or 'auto'!r} reads local files: set dataset_path")
        _check_local(path)
        builder = dataset if dataset in LOCAL_BUILDERS else infer_builder(path)
        if os.path.isdir(path):
            # Files named after their split (train*.jsonl, validation*.jsonl, ...) are matched by
            # datasets' own patterns.
            return builder, {"data_dir": path}
        return builder, {"data_files": {split: path}}  # a single file or glob is the requested split
    stem = dataset
    for comp in _COMPRESSIONS:
        stem = stem.removesuffix(comp)
    if dataset.startswith(("/", "./", "../", "~")) or os.path.splitext(stem)[1].lower() in _EXTENSION_BUILDERS:
        raise FileNotFoundError(f"dataset not found: {dataset!r} (a local file or folder that does not exist)")
    repo, _, config = dataset.partition(":")
    if repo in HUB_ALIASES and not config:
        repo, config = HUB_ALIASES[repo]
    if "/" not in repo:
        raise ValueError(f"unknown dataset {dataset!r}: use 'builtin', one of {LOCAL_BUILDERS} with "
                         f"dataset_path, a local path, one of {sorted(HUB_ALIASES)}, or 'owner/name[:config]'")
    if dataset_path:
        _check_local(dataset_path)  # a local copy of the hub dataset
    return dataset_path or repo, {"name": config or None}


def load_documents(dataset: str, dataset_path: str | None, split: str = "train", streaming: bool = False):
    """A `datasets.Dataset` (map-style) or `datasets.IterableDataset` (streaming) of documents."""
    path, kwargs = resolve_source(dataset, dataset_path, split)
    try:
        return datasets.load_dataset(path, split=split, streaming=streaming, **kwargs)
    except (FileNotFoundError, KeyError):
        raise
    except Exception as e:
        raise read_error(e, dataset_path or dataset) from None


def is_local(dataset: str) -> bool:
    return dataset in LOCAL_BUILDERS or dataset in ("", "auto", "builtin") or os.path.exists(dataset)


def check_readable(dataset: str, dataset_path: str | None, split: str, text_field: str) -> None:
    """Read the first row of a local source (lazily, as a stream: cheap whatever its size), so an
    empty, undecodable or malformed file, or a missing text column, fails before the model is
    built. Hub sources are checked when they are opened."""
    if dataset == TOKENS:
        read_meta(dataset_path)
        return
    if not is_local(dataset):
        return
    name = dataset_path or dataset
    try:
        first = next(iter(load_documents(dataset, dataset_path, split, streaming=True)))
    except DataError:
        raise
    except Exception as e:
        raise read_error(e, name) from None
    if text_field not in first:
        raise DataError(f"{name} has no column {text_field!r} (columns: {sorted(first)}): set data.text_field")
