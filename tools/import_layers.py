"""The import rules of DESIGN.md ("Packages and who may import whom"), checked on the source:

  * a package imports only the plait packages DESIGN.md allows it (ALLOWED below), and every plait
    package, importing or imported, is one the table knows (a new package joins DESIGN.md and this
    table together);
  * runtime code (packages/*/src) never imports plait.testing;
  * no two modules of one package import each other, directly or round a longer circle, counting
    imports inside functions too (a cycle hidden in a function is still a cycle).

    python tools/import_layers.py          one line per problem, exit 1 if any (the lint session)

`problems(root)` returns them for a test (tests/test_combo_import_layers.py), which also shows
that a deliberately added cycle fails.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# DESIGN.md's package table, as written there ("Packages and who may import whom"); ALLOWED is
# read from it, so the rules checked are the table's own words. A change to the table is copied
# here; tests/test_combo_import_layers.py compares the two where the design card is at hand.
TABLE = """
packages/mesh             plait-mesh             plait.mesh              -> torch
packages/models           plait-models           plait.models            -> torch, safetensors, (triton on GPU)
packages/dataparallel     plait-dataparallel     plait.dataparallel      -> plait.mesh
packages/tensorparallel   plait-tensorparallel   plait.tensorparallel    -> plait.mesh
packages/contextparallel  plait-contextparallel  plait.contextparallel   -> plait.mesh
packages/expertparallel   plait-expertparallel   plait.expertparallel    -> plait.mesh
packages/pipelineparallel plait-pipelineparallel plait.pipelineparallel  -> plait.mesh
packages/data             plait-data             plait.data              -> plait.mesh, tiktoken, tokenizers, datasets
packages/checkpoint       plait-checkpoint       plait.checkpoint        -> plait.mesh, plait.models (HF adapters), DCP, safetensors
packages/trainer          plait-trainer          plait.trainer           -> all of the above, tensorboard
packages/plan             plait-plan             plait.plan              -> plait.trainer (a tool above it: the trainer's own step, traced)
packages/faulttolerance   plait-faulttolerance   plait.faulttolerance    -> plait.mesh, torchft (replica groups over the replicate axis)
packages/testing          plait-testing          plait.testing           -> plait.mesh (run_on_ranks, the step sentinel); its plait-train helpers -> plait.trainer; tests only
"""


def allowed_from_table(table: str) -> dict[str, set[str]]:
    """package -> the plait packages it may import, read from the table's rows: `plait.X` names
    anywhere after the first `->`; "all of the above": every library package of the table (a row
    that is neither "a tool above it" nor "tests only") but the row's own: the composer's, which
    DESIGN.md's prose says composes them all, plait-faulttolerance included, whose row stands
    below it; "a tool above it": also what the package it names may import (the tool runs that
    package's stack)."""
    rows = [row for row in (line.strip() for line in table.splitlines()) if row]
    libraries = {row.split()[0].removeprefix("packages/") for row in rows
                 if "a tool above it" not in row and "tests only" not in row}
    allowed: dict[str, set[str]] = {}
    composers = []
    for row in rows:
        package = row.split()[0].removeprefix("packages/")
        rule = row.split("->", 1)[1]
        names = set(re.findall(r"plait\.(\w+)", rule))
        if "all of the above" in rule:
            names |= libraries - {package}
            composers.append(package)
        if "a tool above it" in rule:
            names |= set().union(*(allowed.get(n, set()) for n in names))
        allowed[package] = names
    # A library that may import a composer would close a circle: none may.
    for package, names in allowed.items():
        if package not in composers and names & set(composers) and package in libraries:
            raise ValueError(f"DESIGN.md's table lets {package} import the composer {sorted(names & set(composers))}")
    return allowed


ALLOWED = allowed_from_table(TABLE)


def _modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module under src/plait."""
    found = {}
    for f in sorted((src / "plait").rglob("*.py")):
        parts = list(f.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = f
    return found


def _imports(module: str, file: Path, is_package: bool) -> set[str]:
    """Every plait module `module` imports, anywhere in it, as absolute dotted names: for
    `from X import name`, X.name (a submodule, if it is one; resolved against the known modules later)."""
    base = module.split(".") if is_package else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("plait.")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base[: len(base) - node.level + 1]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "plait" or target.startswith("plait."):
                # X.name: the submodule where it is one, else X itself (_resolve walks up)
                out |= {f"{target}.{a.name}" for a in node.names}
    return out


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The module `name` refers to: itself, or the longest known module above it (an attribute
    imported from a package is an import of its __init__)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: Tarjan's strongly connected components with more than one module."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def problems(root: Path = ROOT) -> list[str]:
    found = []
    for src in sorted((root / "packages").glob("*/src")):
        package = src.parent.name
        if package not in ALLOWED:
            found.append(f"packages/{package}: plait.{package} is not in DESIGN.md's package table (tools/"
                         "import_layers.py TABLE): add it to both, with what it may import")  # fmt: skip
        known = _modules(src)
        own = f"plait.{package}"
        graph: dict[str, set[str]] = {}
        for module, file in known.items():
            edges = set()
            for name in _imports(module, file, file.name == "__init__.py"):
                top = name.split(".")[1] if name.count(".") else None
                if top is None:
                    continue
                if top != package:
                    if top == "testing" or top not in ALLOWED.get(package, set()):
                        found.append(f"{file.relative_to(root)}: plait.{package} imports plait.{top}, "
                                     f"which DESIGN.md does not allow (it may import: "
                                     f"{', '.join(sorted(ALLOWED.get(package, ()))) or 'no plait package'})")
                    continue
                target = _resolve(name, known)
                if target and target != module and target.startswith(own):
                    edges.add(target)
            graph[module] = edges
        for cycle in _cycles(graph):
            found.append(f"packages/{package}: import cycle among {', '.join(cycle)} (DESIGN.md: no two modules "
                         "of one package import each other; move the shared part into a module both import)")
    return list(dict.fromkeys(found))  # a module importing a package twice: one line


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    print(f"import_layers: {len(found)} problem(s)" if found else "import_layers: the DESIGN.md layers hold")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
