"""Build the built-in offline corpus from text that every CPython install ships.

    python packages/trainer/scripts/build_corpus.py [--out DIR]

Sources, all part of the standard library of the running interpreter (no third-party text):
  * docstrings of the standard-library modules, classes and functions, read with `ast` from the
    `.py` sources (nothing is imported, so no module side effects), one document per module;
  * the interactive-help topics of `pydoc_data.topics` (the language reference excerpts that
    `help("if")` prints), one document per topic;
  * the Zen of Python (`this`, stored rot13-encoded) and CPython's `LICENSE.txt`.

Documents are split deterministically (by a hash of their name) into `train` (~95%) and
`validation` (~5%) and written as gzipped JSON lines `{"text": ..., "source": ...}` to
`src/plait/data/assets/corpus/{train,validation}.jsonl.gz`, which `datasets` reads with its
`json` builder. The shipped files were built with CPython 3.11; rerunning under another version
gives slightly different text, which is why the files are shipped rather than built at run time.
"""

from __future__ import annotations

import argparse
import ast
import codecs
import gzip
import hashlib
import json
import os
import sysconfig
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "src" / "plait" / "data" / "assets"
# Test suites, demos and vendored data are code-heavy or not documentation; skip them.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__",
             "lib2to3", "ensurepip", "turtledemo", "config-3.11-x86_64-linux-gnu"}
VALIDATION_PERCENT = 5


def module_docs(stdlib: Path) -> list[tuple[str, str]]:
    """(module name, its docstrings joined) for every stdlib source file, sorted by name."""
    docs = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(part in SKIP_DIRS or part.startswith("test") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_") or rel.parts[0] == "pydoc_data":
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        parts = []
        module_doc = ast.get_docstring(tree)
        if module_doc:
            parts.append(module_doc)
        for node in ast.walk(tree):
            if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                # One-liners like "Return self." add little text and a lot of repetition.
                if doc and len(doc) >= 40:
                    kind = "class" if isinstance(node, ast.ClassDef) else "def"
                    parts.append(f"{kind} {node.name}:\n{doc}")
        if parts:
            docs.append((f"module:{name}", "\n\n".join(parts)))
    return docs


def help_topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(f"topic:{key}", text.strip()) for key, text in sorted(topics.items())]


def zen_and_license(stdlib: Path) -> list[tuple[str, str]]:
    source = (stdlib / "this.py").read_text(encoding="utf-8")
    encoded = ast.literal_eval(source.split("s = ", 1)[1].split("\n\nd = ", 1)[0])
    docs = [("this", codecs.decode(encoded, "rot13"))]
    license_file = stdlib / "LICENSE.txt"
    if license_file.exists():
        docs.append(("LICENSE.txt", license_file.read_text(encoding="utf-8")))
    return docs


def split_of(name: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little") % 100
    return "validation" if bucket < VALIDATION_PERCENT else "train"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ASSETS / "corpus")
    args = parser.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    docs = zen_and_license(stdlib) + help_topics() + module_docs(stdlib)
    args.out.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        rows = [{"text": text, "source": name} for name, text in docs if split_of(name) == split]
        path = args.out / f"{split}.jsonl.gz"
        # mtime=0 keeps the gzip bytes reproducible.
        with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
            for row in rows:
                f.write((json.dumps(row, ensure_ascii=False) + "\n").encode())
        chars = sum(len(r["text"]) for r in rows)
        print(f"{path}: {len(rows)} documents, {chars / 1e6:.2f} M chars, "
              f"{os.path.getsize(path) / 1e6:.2f} MB on disk")


if __name__ == "__main__":
    main()
