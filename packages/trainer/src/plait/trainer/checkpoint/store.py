"""The checkpoint folder on disk: names, the completion marker, validation, publishing, pruning.

    <folder>/step-000010/              a complete checkpoint: DCP files, rng-rank*.pt, .complete
    <folder>/step-000015.tmp-<run id>/ a save in progress, or one whose process died

A save writes into the temporary folder; when every rank has finished, rank 0 writes `.complete`
(the step, the layout, and the size of every file) and renames the folder to `step-NNNNNN`. A
rename is atomic, so a `step-*` folder without a `.tmp-` suffix is either whole or was damaged
afterwards, which `check` finds by comparing the files with the marker before anything loads.

Plain filesystem code, no collectives: the manager decides on rank 0 and broadcasts.
"""

import contextlib
import json
import os
import re
import shutil
import warnings
from pathlib import Path

from ..config import ConfigError

MARKER = ".complete"
DCP_METADATA = ".metadata"
_STEP = re.compile(r"step-(\d+)")
_TMP = re.compile(r"step-(\d+)\.tmp-([0-9a-f]+)")


class CheckpointError(ConfigError):
    """A checkpoint that cannot be loaded (missing, incomplete, corrupt, another model); one line
    naming the checkpoint and the fix, printed by plait-train like a configuration error."""


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


def write_marker(path: Path, meta: dict) -> None:
    """Record every file of the checkpoint with its size, then the marker itself (last, durably)."""
    files = {
        str(f.relative_to(path)): f.stat().st_size for f in sorted(path.rglob("*")) if f.is_file() and f.name != MARKER
    }
    body = dict(meta, files=files)
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
        if not file.is_file():
            raise CheckpointError(f"checkpoint {path} is corrupt: {name} is missing")
        if file.stat().st_size != size:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: {name} has {file.stat().st_size} bytes, the save wrote {size}"
            )
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


def newest_complete(folder: Path) -> tuple[Path | None, dict | None, list[str]]:
    """The newest checkpoint that passes `check` (or None), and a warning per newer one skipped."""
    warnings = []
    for _, path in reversed(checkpoints(folder)):
        try:
            return path, check(path), warnings
        except CheckpointError as e:
            warnings.append(f"skipping {e}")
    return None, None, warnings


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished temporary folder to its final name (replacing an older save of that step)."""
    if final.exists():
        old = final.with_name(final.name + ".old")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def prune(folder: Path, keep_last: int) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep_last` (0 keeps all); return them."""
    if keep_last <= 0:
        return []
    complete = [path for _, path in checkpoints(folder) if (path / MARKER).is_file()]
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
        if (match and match.group(2) != run_id) or path.name.endswith(".old"):
            shutil.rmtree(path, ignore_errors=True)
            stale.append(path)
    return stale
