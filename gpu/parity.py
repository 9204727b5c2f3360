"""The parity matrix's CUDA subset on this GPU: 2 and 4 ranks sharing it over gloo, each entry
against one rank on the same GPU (tests/test_combo_parity_matrix.py, PLAIT_PARITY_DEVICE=cuda),
after a transformers model (Llama and Qwen3) under FSDP 2 x TP 2 against one process
(tests/test_combo_byom_transformers.py's 4-rank cases, on CUDA likewise).

    python gpu/parity.py --jsonl OUT/parity.jsonl              the lease's `parity` stage, nox -s gpu
    python gpu/parity.py --jsonl OUT/parity.jsonl --dry-run-cpu one entry on the CPU (the dry run)

One JSON line per entry lands in --jsonl as the entry finishes (layout, model, dtype, ranks, the
largest loss / grad-norm / gradient differences, host syncs per step, passed), so what finished is
kept when the lease's time runs out; the transformers cases are one line together. Without CUDA
(and without --dry-run-cpu): one line, exit 0. `--transformers-path DIR`: a site folder with
transformers (the lease's .whl/transformers), on PYTHONPATH for those cases only.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MATRIX = "tests/test_combo_parity_matrix.py"
DRY_RUN_ENTRY = f"{MATRIX}::test_layout_matches_its_reference[llama3-fp32-2-fsdp_2]"
TRANSFORMERS = "tests/test_combo_byom_transformers.py::test_transformers_llama_matches_single_process[4]"
TRANSFORMERS_LAYOUT = "transformers Llama / Qwen3: FSDP 2 x TP 2 (+ SP + loss parallel, eager + 4D mask, Qwen3 +- SP)"


def _pytest(target: str, env: dict, extra: list[str]) -> tuple[int, dict]:
    """pytest on `target`: its exit code and the counts of its junit report."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", target, "-q", "-p", "no:cacheprovider", "-rfs", f"--junitxml={report}",
               *extra]  # fmt: skip
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
        if report.exists():
            for suite in ET.parse(report).getroot().iter("testsuite"):
                for key in counts:
                    counts[key] += int(suite.get(key, 0))
    return rc, counts


def run_transformers(env: dict, path: Path | None, jsonl: Path, extra: list[str]) -> None:
    """The transformers cases on CUDA; one record (skipped where transformers does not import)."""
    if path is not None:
        env = {**env, "PYTHONPATH": os.pathsep.join([env["PYTHONPATH"], str(path)])}
    start = time.perf_counter()
    rc, counts = _pytest(TRANSFORMERS, env, extra)
    record = {"layout": TRANSFORMERS_LAYOUT, "model": "transformers", "dtype": "float32", "ranks": 4,
              "device": env["PLAIT_PARITY_DEVICE"], "tolerance": 1e-5, "passed": rc == 0 and counts["skipped"] == 0,
              "skipped": counts["skipped"] > 0, "seconds": time.perf_counter() - start}  # fmt: skip
    with jsonl.open("a") as f:
        f.write(json.dumps(record) + "\n")


def outcome(jsonl: Path) -> tuple[int, list[str]]:
    """(entries recorded, the failed ones as "model dtype: layout"; skipped ones are not failures)."""
    records = [json.loads(line) for line in jsonl.read_text().splitlines()] if jsonl.exists() else []
    failed = [f"{r['model']} {r['dtype']}: {r['layout']}" for r in records if not r["passed"] and not r.get("skipped")]
    return len(records), failed


def summary(jsonl: Path) -> str:
    count, failed = outcome(jsonl)
    return f"{count - len(failed)} of {count} entries passed" + (f"; failed: {'; '.join(failed)}" if failed else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jsonl", type=Path, required=True, help="one JSON line per entry, appended")
    parser.add_argument("--dry-run-cpu", action="store_true", help="one entry on the CPU instead")
    parser.add_argument("--transformers-path", type=Path, help="a site folder with transformers, for its cases")
    parser.add_argument("pytest_args", nargs="*", help="passed to pytest (after --)")
    args = parser.parse_args(argv)
    import torch

    if not args.dry_run_cpu and not torch.cuda.is_available():
        print(f"plait CUDA parity: no CUDA device (torch {torch.__version__}): nothing run.")
        return 0
    args.jsonl.parent.mkdir(parents=True, exist_ok=True)
    env = {"PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", **os.environ, "PLAIT_PARITY_JSONL": str(args.jsonl.resolve())}
    env["PLAIT_PARITY_DEVICE"] = "cpu" if args.dry_run_cpu else "cuda"
    src = [str(p) for p in sorted((REPO / "packages").glob("*/src"))]
    env["PYTHONPATH"] = os.pathsep.join([*src, *filter(None, [os.environ.get("PYTHONPATH")])])
    start = time.perf_counter()
    if not args.dry_run_cpu:
        run_transformers(env, args.transformers_path, args.jsonl, args.pytest_args)
    rc, _ = _pytest(DRY_RUN_ENTRY if args.dry_run_cpu else MATRIX, env, args.pytest_args)
    device = "cpu (dry run)" if args.dry_run_cpu else torch.cuda.get_device_name(0)
    print(f"plait CUDA parity: {device}, torch {torch.__version__}: {summary(args.jsonl)} "
          f"in {time.perf_counter() - start:.0f} s")  # fmt: skip
    return 0 if rc == 0 and not outcome(args.jsonl)[1] else 1


if __name__ == "__main__":
    sys.exit(main())
