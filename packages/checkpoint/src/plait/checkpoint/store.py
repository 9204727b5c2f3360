"""The checkpoint folder on disk: names, the completion marker, validation, publishing, pruning.

    <folder>/step-000010/              a complete checkpoint: DCP files, rng-rank*.pt, .complete
    <folder>/step-000015.tmp-<run id>/ a save in progress, or one whose process died

A save writes into the temporary folder; when every rank has finished, rank 0 writes `.complete`
(the step, the layout, the size and CRC-32 of every file, the run id and a publication number)
and renames the folder to `step-NNNNNN`. A rename is atomic, so a `step-*` folder without a
`.tmp-` suffix is either whole or was damaged afterwards: `check` compares the files' sizes with
the marker, `verify_checksums` their bytes (each rank hashes the files it wrote, and on load a
share of them, so no rank reads the whole checkpoint alone).

"Newest" means most recently published, not highest step: after a run resumed an older step
(`load_step`), its checkpoints win over the abandoned timeline's higher steps, for resuming and
for pruning.

Plain filesystem code, no collectives: the manager decides on rank 0 and broadcasts.
"""

import contextlib
import json
import os
import re
import shutil
import warnings
import zlib
from pathlib import Path

from plait.mesh.errors import ConfigError, InfrastructureFault

MARKER = ".complete"
DCP_METADATA = ".metadata"
_STEP = re.compile(r"step-(\d+)")
_TMP = re.compile(r"step-(\d+)\.tmp-([0-9a-f]+)")
_OLD = re.compile(r"step-\d+\.old")
# Files a rank writes itself: DCP's data files __<rank>_<n>.distcp and the RNG file rng-rank<rank>.pt.
_RANK_FILE = re.compile(r"__(\d+)_.*|rng-rank(\d+)\.pt")
_CHUNK = 8 << 20
_RNG_FILE = re.compile(r"rng-rank\d+\.pt")
# Key `check` adds to the metadata it returns when only an RNG file is damaged.
RNG_PROBLEM = "rng_problem"


def is_rng_file(name: str) -> bool:
    return _RNG_FILE.fullmatch(name) is not None


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, another model); one line
    naming the checkpoint and the fix, printed by plait-train like a configuration error."""


class CheckpointWriteError(InfrastructureFault):
    """A save that could not be written (disk full, read-only, a failed background write): one
    line naming the folder and the cause; the checkpoints already published stay."""


def cause_of(error: BaseException) -> str:
    """The root cause of a failed write, in words: the first OSError found through DCP's per-rank
    failures and the exception chain ("No space left on device (path) on rank 1"), else the first
    exception under DCP's wrapper that is not one ("RuntimeError: ... file write failed on rank 1":
    torch's zip writer on a full disk), else the first line."""
    seen, stack = set(), [(error, None)]
    fallback = None
    while stack:
        e, rank = stack.pop(0)
        if isinstance(e, tuple):  # DCP's WrappedException: (exception, frames)
            stack.extend((x, rank) for x in e if isinstance(x, BaseException))
            continue
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        where = f" on rank {rank}" if rank is not None else ""
        if isinstance(e, OSError) and e.strerror:
            return e.strerror + (f" ({e.filename})" if e.filename else "") + where
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: WrappedException}
        if isinstance(failures, dict):
            stack.extend((failure, r) for r, failure in failures.items())
        elif fallback is None and e is not error and str(e).strip():
            text = str(e).strip().splitlines()[0]
            hint = " (the disk full?)" if "write failed" in text else ""
            fallback = f"{type(e).__name__}: {text[:300]}{hint}{where}"
        stack.extend((x, rank) for x in (getattr(e, "exc", None), e.__cause__, e.__context__))
    if fallback:
        return fallback
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


@contextlib.contextmanager
def single_process_quiet():
    """Silence DCP's warning that a process without a process group reads or writes alone (intended)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def step_name(step: int) -> str:
    return f"step-{step:06d}"


def temp_path(folder: Path, step: int, run_id: str) -> Path:
    return folder / f"{step_name(step)}.tmp-{run_id}"


def checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every `step-N` folder (complete or not, temporaries excluded), oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        match = _STEP.fullmatch(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _file_names(path: Path) -> list[str]:
    return [str(f.relative_to(path)) for f in sorted(path.rglob("*")) if f.is_file() and f.name != MARKER]


def owned_files(path: Path, rank: int, world_size: int) -> list[str]:
    """The files of a written checkpoint that `rank` hashes: those it wrote; rank 0 also the rest."""
    owned = []
    for name in _file_names(path):
        match = _RANK_FILE.fullmatch(name)
        owner = int(match.group(1) or match.group(2)) if match else 0
        if (owner if owner < world_size else 0) == rank:
            owned.append(name)
    return owned


def crc32(file: Path) -> str:
    """CRC-32 of a file, streamed (zlib releases the GIL: ~4 GB/s, fine on a background thread)."""
    value = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def checksums(path: Path, names: list[str]) -> dict[str, str]:
    return {name: crc32(path / name) for name in names}


def verify_checksums(path: Path, meta: dict, names: list[str] | None = None) -> str | None:
    """The first of `names` (default: all recorded) whose bytes differ from the save's, as a
    one-line problem, or None. Checkpoints from before checksums were recorded pass."""
    recorded = meta.get("checksums") or {}
    for name in recorded if names is None else names:
        file = path / name
        if not file.is_file():
            return f"checkpoint {path} is corrupt: {name} is missing"
        actual = crc32(file)
        if actual != recorded[name]:
            return f"checkpoint {path} is corrupt: {name} does not match its checksum (crc32 {actual}, saved {recorded[name]})"
    return None


def write_marker(path: Path, meta: dict, crcs: dict[str, str] | None = None) -> None:
    """Record every file of the checkpoint with its size (and checksum), then the marker itself
    (last, durably)."""
    files = {name: (path / name).stat().st_size for name in _file_names(path)}
    body = dict(meta, files=files)
    if crcs is not None:
        missing = sorted(files.keys() - crcs.keys())
        if missing:
            raise CheckpointError(f"checkpoint {path}: no checksum was computed for {', '.join(missing[:3])}")
        body["checksums"] = {name: crcs[name] for name in files}
    tmp = path / (MARKER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(body, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path / MARKER)
    _fsync_dir(path)


def read_marker(path: Path) -> dict:
    """The marker's metadata, or CheckpointError if it is missing or unreadable."""
    marker = path / MARKER
    if not marker.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: no {MARKER} marker (the save did not finish)")
    try:
        meta = json.loads(marker.read_text())
        int(meta["step"]), dict(meta["files"])
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {path} is corrupt: its {MARKER} marker is unreadable ({e})") from None
    return meta


def check(path: Path) -> dict:
    """Validate a checkpoint before anything is loaded from it; return its marker metadata.

    The marker must parse, every file it lists must exist with its recorded size, and DCP's
    `.metadata` must unpickle and point only at bytes that exist. Raises CheckpointError naming
    the checkpoint and what is wrong.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint {path} does not exist")
    meta = read_marker(path)
    for name, size in meta["files"].items():
        file = path / name
        problem = None
        if not file.is_file():
            problem = f"checkpoint {path} is corrupt: {name} is missing"
        elif file.stat().st_size != size:
            problem = f"checkpoint {path} is corrupt: {name} has {file.stat().st_size} bytes, the save wrote {size}"
        if problem and is_rng_file(name):
            # Model and optimizer may still be whole: the run resumes re-seeded (manager.py).
            meta.setdefault(RNG_PROBLEM, problem)
        elif problem:
            raise CheckpointError(problem)
    if DCP_METADATA not in meta["files"]:
        raise CheckpointError(f"checkpoint {path} is corrupt: no DCP {DCP_METADATA} file")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        metadata = FileSystemReader(str(path)).read_metadata()
    except Exception as e:  # any unpickling failure: the file is not what DCP wrote
        raise CheckpointError(
            f"checkpoint {path} is corrupt: DCP {DCP_METADATA} is unreadable ({type(e).__name__})"
        ) from None
    ends: dict[str, int] = {}
    for info in metadata.storage_data.values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in ends.items():
        file = path / name
        if not file.is_file() or file.stat().st_size < end:
            raise CheckpointError(f"checkpoint {path} is corrupt: DCP data file {name} is missing or truncated")
    return meta


# Folders whose marker is missing or unreadable sort as the newest: they are looked at (and
# skipped with a warning) first, as they were when "newest" meant the highest step.
_UNREADABLE = 2**62


def _publication_key(step: int, path: Path) -> tuple[int, int]:
    """Order of publication: the marker's number; markers without one (saves from before it was
    recorded) come before every numbered one, by step."""
    try:
        published = json.loads((path / MARKER).read_text()).get("published", -1)
        return (published if isinstance(published, int) else -1), step
    except (OSError, ValueError, AttributeError):
        return _UNREADABLE, step


def by_publication(folder: Path) -> list[Path]:
    """Every `step-N` folder, the most recently published last."""
    return [path for _, path in sorted((_publication_key(step, path), path) for step, path in checkpoints(folder))]


def next_publication(folder: Path) -> int:
    """The publication number of the next checkpoint published in `folder`."""
    keys = (_publication_key(step, path)[0] for step, path in checkpoints(folder))
    return 1 + max((key for key in keys if key != _UNREADABLE), default=0)


def newest_complete(folder: Path, skip: set | None = None) -> tuple[Path | None, dict | None, list[str]]:
    """The most recently published checkpoint that passes `check` (or None), and a warning per
    newer one skipped. Paths in `skip` are passed over silently; failing ones are added to it."""
    warnings = []
    skip = set() if skip is None else skip
    for path in reversed(by_publication(folder)):
        if str(path) in skip:
            continue
        try:
            return path, check(path), warnings
        except CheckpointError as e:
            warnings.append(f"skipping {e}")
            skip.add(str(path))
    return None, None, warnings


def publish(tmp: Path, final: Path, keep_as: str | None = None) -> Path | None:
    """Rename a finished temporary folder to its final name. An older save of that step is
    replaced, or with `keep_as` (a checkpoint this run rejected) renamed `step-N.<keep_as>` and
    kept; returns that path."""
    kept = None
    if final.exists():
        old = final.with_name(final.name + (f".{keep_as}" if keep_as else ".old"))
        if not keep_as:
            shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        if keep_as:
            kept = old
        else:
            shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)
    return kept


def prune(folder: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints published before the newest `keep_last` (0 keeps all); return them."""
    if keep_last <= 0:
        return []
    complete = [path for path in by_publication(folder) if (path / MARKER).is_file()]
    removed = complete[:-keep_last]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def remove_stale_temporaries(folder: Path, run_id: str) -> list[Path]:
    """Delete temporary folders of other runs (saves whose process died); return them."""
    if not folder.is_dir():
        return []
    stale = []
    for path in folder.iterdir():
        match = _TMP.fullmatch(path.name)
        # (".old": a replaced save of ours that a killed publish left; never another name of the user's)
        if (match and match.group(2) != run_id) or _OLD.fullmatch(path.name):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale
