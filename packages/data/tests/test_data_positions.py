"""Document positions (each input token's offset inside its document, the third tensor of every
micro-batch), checked against the documents tokenised one by one on the on-the-fly, streaming
and pre-tokenised paths, across rows, steps and epochs, and after resume mid-document under
another layout; and the data package's imports form no cycle.

That positions are the same for every dp degree, accumulation split, exchange, streaming split
and prefetch is checked where those are: the loader tests compare inputs and positions together
(test_trainer_data.py, _sharing, _distributed, _pretokenized, _prefetch)."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import plait.data
from plait.data import build_dataloader, build_tokenizer
from plait.data.pretokenize import pretokenize

SEQ, BATCH, ACCUM, STEPS = 16, 2, 2, 12


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer(None)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Documents of 3 tokens (shorter than a row) up to several rows long, so rows start at a
    document, inside one, and steps begin mid-document; the stream wraps into a second epoch."""
    root = tmp_path_factory.mktemp("positions")
    docs = [("x" if i % 4 == 1 else f"Doc {i}: " + "Readability counts. " * (i % 9)) for i in range(23)]
    path = root / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    folders = {split: root / f"tokens-{split}" for split in ("train", "validation")}
    for split, folder in folders.items():
        pretokenize("json", str(path), folder, split=split)
    return docs, str(path), {split: str(f) for split, f in folders.items()}


def make(corpus, kind, split, batch=BATCH, accum=ACCUM, rank=0, degree=1):
    _, path, folders = corpus
    if kind == "tokens":
        return build_dataloader("tokens", folders[split], build_tokenizer(None), SEQ, batch, accum, rank, degree, 0,
                                split=split)
    return build_dataloader("json", path, build_tokenizer(None), SEQ, batch, accum, rank, degree, 0, split=split,
                            streaming=kind == "streaming")


def take(ld, steps):
    """`steps` steps -> ([steps, rows, SEQ] inputs, the same positions); checks the format."""
    xs, ps = [], []
    for _ in range(steps):
        step = next(ld)
        for x, y, p in step:
            assert p.dtype == torch.int32 and p.shape == x.shape == y.shape and p.device.type == "cpu"
        xs.append(torch.cat([x for x, _, _ in step]))
        ps.append(torch.cat([p for _, _, p in step]))
    return torch.stack(xs), torch.stack(ps)


def expected_stream(tok, docs, order):
    """Tokens and document positions of the stream built from each document tokenised alone."""
    ids = [tok.encode(docs[i], bos=True, eos=True) for i in order]
    return np.concatenate(ids), np.concatenate([np.arange(len(d)) for d in ids])


@pytest.mark.parametrize("kind,split", [("map", "train"), ("map", "validation"), ("streaming", "train"),
                                        ("tokens", "train"), ("tokens", "validation")])
def test_positions_are_offsets_in_the_documents_tokenised_alone(tok, corpus, kind, split):
    docs = corpus[0]
    ld = make(corpus, kind, split)
    x, p = take(ld, STEPS)
    # The document order: the loader's seeded permutation (map-style train split), else file order.
    epochs = range(ld.state_dict()["epoch"] + 1)
    shuffled = kind != "streaming" and split == "train"
    order = np.concatenate([ld.documents.order(e) if shuffled else np.arange(len(docs)) for e in epochs])
    tokens, positions = expected_stream(tok, docs, order)
    rows = STEPS * BATCH * ACCUM
    windows = np.arange(rows)[:, None] * (SEQ + 1) + np.arange(SEQ)  # [rows, SEQ] input indices
    assert torch.equal(x.reshape(rows, SEQ), torch.from_numpy(tokens[windows]).long())
    assert torch.equal(p.reshape(rows, SEQ), torch.from_numpy(positions[windows]).int())
    # The representation itself: 0 exactly at each <bos>, +1 along a document, and rows (first
    # rows of a step too) that start inside a document continue its offset.
    assert torch.equal(p == 0, x == tok.bos_id)
    inside = p[..., 1:] != 0
    assert torch.equal(p[..., 1:][inside], p[..., :-1][inside] + 1)
    assert (p[:, 1:, 0] > 0).any() and (p[1:, 0, 0] > 0).any()
    assert len(epochs) > 1  # the stream wrapped into a second epoch


@pytest.mark.parametrize("kind", ["map", "streaming", "tokens"])
def test_resume_mid_document_continues_the_positions(corpus, kind):
    ld = make(corpus, kind, "train")
    for _ in range(STEPS):  # stop where the next row starts inside a document
        next(ld)
        state = json.loads(json.dumps(ld.state_dict()))
        if state["offset"] > 0:
            break
    assert state["offset"] > 0
    x, p = take(ld, 3)
    assert p[0, 0, 0] == state["offset"]  # the document's true offset, not a restart at 0
    # Resumed under the same layout and under others of the same global batch (dp ranks of one
    # process, each tokenising alone).
    for degree, batch, accum in [(1, BATCH, ACCUM), (1, 1, 4), (2, 1, 2), (4, 1, 1)]:
        ranks = [make(corpus, kind, "train", batch, accum, r, degree) for r in range(degree)]
        for r in ranks:
            r.load_state_dict(state)
        got = [take(r, 3) for r in ranks]
        assert torch.equal(torch.cat([g[0] for g in got], dim=1), x), (kind, degree)
        assert torch.equal(torch.cat([g[1] for g in got], dim=1), p), (kind, degree)


def test_positions_of_a_range_from_the_layout():
    from plait.data.stream import document_positions

    # Documents [-3, 2), [2, 2) (empty), [2, 6), [6, 20) relative to the next token.
    spans = [(0, None, -3, 2), (1, None, 2, 2), (2, None, 2, 6), (3, None, 6, 20)]
    assert document_positions(spans, 0, 9).tolist() == [3, 4, 0, 1, 2, 3, 0, 1, 2]
    assert document_positions(spans, 4, 8).tolist() == [2, 3, 0, 1]  # a rank's rows from mid-stream
    assert document_positions(spans, 7, 8).dtype == np.int32


def _data_imports() -> dict[str, set[str]]:
    """Module -> the modules of plait.data it imports, anywhere in it (function-level
    imports included: a cycle hidden in a function is still a cycle)."""
    folder = Path(plait.data.__file__).parent
    graph = {}
    for f in sorted(folder.glob("*.py")):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level == 1:
                module = node.module
            elif node.level == 0 and (node.module or "").startswith("plait.data"):
                module = node.module.removeprefix("plait.data").lstrip(".")
            else:
                continue
            # `from . import x` / `from plait.data import x`: the package, or a submodule x.
            names = [module.split(".")[0]] if module else [a.name for a in node.names]
            deps |= {n if (folder / f"{n}.py").is_file() else "__init__" for n in names}
        graph[f.stem] = deps - {f.stem}
    return graph


def test_data_package_imports_form_no_cycle():
    graph = _data_imports()
    assert {"loader", "stream", "documents", "sources", "token_files", "pretokenize"} <= set(graph)
    done, path = set(), []

    def visit(module):
        if module in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(module):] + [module]))
        if module not in done:
            path.append(module)
            for dep in sorted(graph.get(module, ())):
                visit(dep)
            path.pop()
            done.add(module)

    for module in graph:
        visit(module)
    # The error type and the token-folder format are leaves every reader shares.
    assert graph.get("errors") == set() and graph.get("token_format") == {"errors"}
