"""A GPU lease's raw outputs into the repository: the folder the device call brought back (its
`files_at`, gpu/lease.sh's $OUT) copied to benchmarks/leases/<date>-<commit>/, so that every
RESULTS table can be checked against, and regenerated from, what the lease wrote.

    python benchmarks/lease_archive.py FILES_AT [--dest benchmarks/leases] [--commit C]
        [--max-trace-mb 4] [--results benchmarks/RESULTS.md] [--force] [--dry-run-ok]

Copied: the folder's own text files (env.txt, stages.tsv, bench.jsonl, parity.jsonl, gemm.jsonl,
plan.jsonl, varlen.jsonl, nvidia-smi.txt, signature.txt, suite.log, the other stages' logs and
records, table.md: *.txt, *.tsv, *.jsonl, *.log, *.md; one over 2 MB keeps its last 2 MB, marked)
and runs/ (each run's last log lines, metrics.jsonl, and its profiler trace gzipped: a trace of
at most --max-trace-mb gzipped is kept, a larger one left out and listed). MANIFEST.txt lists every
file kept (bytes, sha256) and every one left out. The date is env.txt's; the commit --commit,
else env.txt's (`-dirty` where the lease ran uncommitted changes). Then table.md is regenerated
from the copy (benchmarks/lease_table.py) and, with --results, prepended to RESULTS.md. A dry
run's folder (sample outputs) is refused unless --dry-run-ok; an existing folder unless --force.
benchmarks/leases/README.md describes the layout and every field.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import sys
from pathlib import Path

from lease_mfu_figure import draw_mfu
from lease_table import prepend, read_env, read_jsonl, section

HERE = Path(__file__).resolve().parent
TEXT = (".txt", ".tsv", ".jsonl", ".log", ".md")
MAX_TEXT_BYTES = 2 * 2**20


def folder_name(out: Path, commit: str | None) -> str:
    env = read_env(out)
    date = env.get("date", "unknown-date").split(" ")[0]
    if commit is None:
        words = env.get("commit", "unknown").split()
        commit = (words[0] if words else "unknown") + ("-dirty" if "uncommitted" in env.get("commit", "") else "")
    return f"{date}-{commit}"


def _copy_text(src: Path, dst: Path) -> None:
    data = src.read_bytes()
    if len(data) > MAX_TEXT_BYTES:
        head = f"[lease_archive: {len(data)} bytes, the last {MAX_TEXT_BYTES} kept]\n".encode()
        data = head + data[-MAX_TEXT_BYTES:]
    dst.write_bytes(data)


def _copy_trace(src: Path, dst: Path, max_bytes: int) -> str | None:
    """The trace gzipped at `dst` (.json.gz), or why it was left out."""
    if src.suffix != ".gz":
        with open(src, "rb") as f, gzip.open(dst, "wb", compresslevel=9) as g:
            shutil.copyfileobj(f, g)
    else:
        shutil.copy(src, dst)
    if dst.stat().st_size > max_bytes:
        size = dst.stat().st_size
        dst.unlink()
        return f"{size} bytes gzipped, over {max_bytes}"
    return None


def archive(out: Path, dest: Path, max_trace_bytes: int) -> list[str]:
    """Copy OUT's raw outputs to DEST; what was left out (for MANIFEST.txt)."""
    dest.mkdir(parents=True, exist_ok=True)
    left_out = []
    for src in sorted(p for p in out.iterdir() if p.is_file() and p.suffix in TEXT):
        _copy_text(src, dest / src.name)
    runs = out / "runs"
    for src in sorted(runs.iterdir()) if runs.is_dir() else []:
        if not src.is_file():
            continue
        (dest / "runs").mkdir(exist_ok=True)
        if src.name.endswith((".json", ".json.gz")):
            name = src.name if src.name.endswith(".gz") else src.name + ".gz"
            why = _copy_trace(src, dest / "runs" / name, max_trace_bytes)
            if why:
                left_out.append(f"left out  runs/{src.name}: {why}")
        elif src.suffix in TEXT:
            _copy_text(src, dest / "runs" / src.name)
    return left_out


def manifest(dest: Path, left_out: list[str]) -> list[str]:
    kept = sorted(p for p in dest.rglob("*") if p.is_file() and p.name != "MANIFEST.txt")
    lines = [f"{p.relative_to(dest)}  {p.stat().st_size}  {hashlib.sha256(p.read_bytes()).hexdigest()}" for p in kept]
    return [
        "# path  bytes  sha256 (benchmarks/lease_archive.py; table.md regenerated from the rest)",
        *lines,
        *left_out,
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder the lease's device call brought back ($OUT)")
    parser.add_argument("--dest", type=Path, default=HERE / "leases", help="where the dated folders go")
    parser.add_argument("--commit", help="the commit the lease ran (default: env.txt's)")
    parser.add_argument("--max-trace-mb", type=float, default=4.0, help="keep a gzipped trace up to this size")
    parser.add_argument("--results", type=Path, help="prepend the regenerated section to this RESULTS.md")
    parser.add_argument("--force", action="store_true", help="write into an existing folder")
    parser.add_argument("--dry-run-ok", action="store_true", help="archive a dry run's folder (sample outputs)")
    args = parser.parse_args(argv)
    if not (args.out / "env.txt").exists():
        parser.error(f"{args.out}: no env.txt (not a gpu/lease.sh output folder)")
    if read_env(args.out).get("dry_run") == "1" and not args.dry_run_ok:
        print(f"lease_archive: {args.out} is a dry run (sample outputs): not archived", file=sys.stderr)
        return 2
    dest = args.dest / folder_name(args.out, args.commit)
    if dest.exists() and any(dest.iterdir()) and not args.force:
        print(f"lease_archive: {dest} exists (--force writes into it)", file=sys.stderr)
        return 2
    left_out = archive(args.out, dest, int(args.max_trace_mb * 2**20))
    text = section(dest, args.commit)
    # The MFU of each run as bars next to the table (matplotlib where installed).
    figure = draw_mfu(read_jsonl(dest / "bench.jsonl"), dest / "mfu.png")
    (dest / "table.md").write_text(text + ("\n![MFU per run](mfu.png)\n" if figure else ""))
    lines = manifest(dest, left_out)
    (dest / "MANIFEST.txt").write_text("\n".join(lines) + "\n")
    if args.results:
        prepend(args.results, text + (f"\n![MFU per run](leases/{dest.name}/mfu.png)\n" if figure else ""))
    print(
        f"lease_archive: {dest}: {len(lines) - 1 - len(left_out)} files, {len(left_out)} left out "
        f"(MANIFEST.txt); table.md regenerated" + (f", prepended to {args.results}" if args.results else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
