"""DESIGN.md's import rules hold on the source (tools/import_layers.py), and the check fails on a
deliberately added cycle and a forbidden import."""

import importlib.util
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_layers", ROOT / "tools" / "import_layers.py")
import_layers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(import_layers)


def _package(root: Path, name: str, files: dict[str, str]) -> None:
    folder = root / "packages" / name / "src" / "plait" / name
    for path, text in files.items():
        (folder / path).parent.mkdir(parents=True, exist_ok=True)
        (folder / path).write_text(textwrap.dedent(text))


def test_the_design_layers_hold_on_main():
    assert import_layers.problems(ROOT) == []


def test_the_rules_are_read_from_the_design_tables_words():
    """Issue 53, item 10: the checked rules are the table's, row by row (the card itself lives
    beside the repository, in ../shared; where it is at hand, its table is the tool's, to the
    character)."""
    allowed = import_layers.ALLOWED
    parallel = {"dataparallel", "tensorparallel", "contextparallel", "expertparallel", "pipelineparallel"}
    assert allowed["mesh"] == allowed["models"] == set()
    assert all(allowed[p] == {"mesh"} for p in parallel) and allowed["data"] == {"mesh"}
    assert allowed["checkpoint"] == {"mesh", "models"} and allowed["faulttolerance"] == {"mesh"}
    # "all of the above": every library of the table, plait-faulttolerance's row below it included
    assert allowed["trainer"] == {"mesh", "models", "data", "checkpoint", "faulttolerance"} | parallel
    assert allowed["plan"] == allowed["trainer"] | {"trainer"} and allowed["testing"] == {"mesh", "trainer"}
    card = ROOT.parent / "shared" / "DESIGN.md"
    if card.is_file():
        block = card.read_text().split("## Packages and who may import whom", 1)[1].split("```")[1]
        rows = [line for line in block.splitlines() if line.startswith("packages/")]
        assert rows == [line for line in import_layers.TABLE.splitlines() if line]


def test_a_cycle_through_a_function_level_import_fails(tmp_path):
    _package(tmp_path, "trainer", {
        "__init__.py": "",
        "train.py": "from .step import run_step\n",
        "step.py": "def run_step():\n    from .train import Trainer  # hidden in a function: still a cycle\n",
        "config.py": "",
    })  # fmt: skip
    found = import_layers.problems(tmp_path)
    assert len(found) == 1 and "import cycle among plait.trainer.step, plait.trainer.train" in found[0]


def test_a_longer_circle_and_a_package_init_circle_fail(tmp_path):
    _package(tmp_path, "data", {
        "__init__.py": "from .loader import build\n",
        "loader.py": "from . import stream\n",
        "stream.py": "from plait.data import build  # the package's __init__, which imports loader\n",
    })  # fmt: skip
    found = import_layers.problems(tmp_path)
    assert len(found) == 1 and "plait.data, plait.data.loader, plait.data.stream" in found[0]


def test_a_forbidden_import_fails(tmp_path):
    _package(tmp_path, "models", {"__init__.py": "import plait.mesh\n"})
    _package(tmp_path, "tensorparallel", {"__init__.py": "from plait.dataparallel import x\n"})
    _package(tmp_path, "trainer", {"__init__.py": "", "run.py": "from plait.testing import run_on_ranks\n"})
    found = import_layers.problems(tmp_path)
    assert len(found) == 3
    assert any("plait.models imports plait.mesh" in f for f in found)
    assert any("plait.tensorparallel imports plait.dataparallel" in f for f in found)
    assert any("plait.trainer imports plait.testing" in f for f in found)


def test_imports_that_only_look_circular_pass(tmp_path):
    _package(tmp_path, "checkpoint", {
        "__init__.py": "from .store import CheckpointError\n",
        "store.py": "class CheckpointError(ValueError): ...\n",
        "export.py": "from . import store\nfrom .store import CheckpointError\n",
    })  # fmt: skip
    assert import_layers.problems(tmp_path) == []


def test_a_package_the_table_does_not_know_fails(tmp_path):
    """Issue 53: a plait package outside DESIGN.md's table was not checked at all."""
    _package(tmp_path, "mesh", {"__init__.py": ""})
    _package(tmp_path, "newthing", {"__init__.py": "from plait.mesh import build_meshes\n"})
    _package(tmp_path, "data", {"__init__.py": "from plait.newthing import x\n"})
    found = import_layers.problems(tmp_path)
    assert any("packages/newthing: plait.newthing is not in DESIGN.md's package table" in f for f in found), found
    assert any("plait.data imports plait.newthing, which DESIGN.md does not allow" in f for f in found), found
