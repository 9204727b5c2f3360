"""Where a Hugging Face export may be written, and how it is published without deleting anything
it did not write.

An export is written into a sibling temporary folder `.<name>.tmp-<hex>` (the same filesystem,
so the final step is one rename) that holds `EXPORT_MARKER` from its first moment. `--output`
may be a new folder, an empty one, or an earlier export of ours (it holds the marker): only that
one is replaced, by renaming it aside, renaming the new one in and deleting the old -- the files
the old one WROTE (its marker lists them). Files a user added to it since (a model card, tokenizer
files, eval results) are moved into the new export and named in one line; only then is the old
folder deleted, and not at all if any of them could not be moved. Any other non-empty folder, a
file, a checkpoint (or a folder holding or inside one) is refused with one line before anything
is read.
"""

import json
import os
import re
import shutil
from pathlib import Path

from .store import MARKER, CheckpointError

EXPORT_MARKER = ".plait-hf-export"
_CHECKPOINT_NAME = re.compile(r"step-\d+(\..*)?")


def is_our_export(path: Path) -> bool:
    return (Path(path) / EXPORT_MARKER).is_file()


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _holds_checkpoints(path: Path) -> bool:
    """A run or checkpoint folder: a checkpoint marker in it or one level below, or a run lock."""
    if (path / MARKER).is_file() or (path / ".plait-run.lock").exists() or (path / "metrics.jsonl").is_file():
        return True
    try:
        return any((child / MARKER).is_file() for child in path.iterdir() if child.is_dir())
    except OSError:
        return False


def check_output(output: str | Path, where: str, protected: list[Path] = ()) -> Path:
    """Raise CheckpointError (one line, naming `where`) unless `output` may receive an export.

    `protected` are folders that must survive whatever happens: the checkpoint being exported,
    its run folder. The output may not be one of them, hold one, or lie inside a checkpoint.
    """
    out = Path(os.path.abspath(output))
    for folder in protected:
        folder = Path(os.path.abspath(folder))
        if _inside(folder, out):
            raise CheckpointError(f"{where} = {str(output)!r} is or holds {folder}, which an export must not "
                                  "replace: choose a new folder")
        if (folder / MARKER).is_file() and _inside(out, folder):
            raise CheckpointError(f"{where} = {str(output)!r} is inside the checkpoint {folder}: choose a "
                                  "folder outside it")
    for parent in out.parents:
        if parent.exists() and not parent.is_dir():
            raise CheckpointError(f"{where} = {str(output)!r} lies under {parent}, which is a file, not a folder: "
                                  "choose another path")
        if (parent / MARKER).is_file():
            raise CheckpointError(f"{where} = {str(output)!r} is inside the checkpoint {parent}: choose a "
                                  "folder outside it")
    if _CHECKPOINT_NAME.fullmatch(out.name):
        raise CheckpointError(f"{where} = {str(output)!r} is named like a checkpoint (step-N): choose another name")
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise CheckpointError(f"{where} = {str(output)!r} exists and is not a folder: choose a new folder")
        if not is_our_export(out) and any(out.iterdir()):
            what = "a run or checkpoint folder" if _holds_checkpoints(out) else "a folder"
            raise CheckpointError(
                f"{where} = {str(output)!r} is {what} with files that no hf_export wrote (it has no "
                f"{EXPORT_MARKER}): choose a new or empty folder; nothing was changed"
            )
    return out


def make_temp(output: Path, origin: dict) -> Path:
    """The sibling folder the export is written into, marked as ours before anything else."""
    output.parent.mkdir(parents=True, exist_ok=True)
    while True:
        tmp = output.with_name(f".{output.name}.tmp-{os.urandom(4).hex()}")
        try:
            tmp.mkdir()  # not mkdtemp: the export keeps the user's umask (others may read it)
            break
        except FileExistsError:
            continue
    (tmp / EXPORT_MARKER).write_text(json.dumps(origin, indent=1) + "\n")
    return tmp


def discard(tmp: Path) -> None:
    """Remove a temporary export folder after a failure (only ours: it holds the marker)."""
    if is_our_export(tmp) and tmp.name.startswith("."):
        shutil.rmtree(tmp, ignore_errors=True)


# What an export writes, for markers written before they listed their files.
_EXPORT_FILES = re.compile(r"(.*\.safetensors|.*\.safetensors\.index\.json|config\.json|generation_config\.json)")


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file() and p.name != EXPORT_MARKER)


def _written_by_export(folder: Path) -> set[str] | None:
    """The files the export in `folder` wrote (its marker's list), or None for an older marker."""
    try:
        listed = json.loads((folder / EXPORT_MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        return None
    return set(listed) if isinstance(listed, list) else None


def _user_files(old: Path) -> list[str]:
    ours = _written_by_export(old)
    return [f for f in _files(old) if (f not in ours if ours is not None else not _EXPORT_FILES.fullmatch(f))]


def publish(tmp: Path, output: Path, where: str) -> Path:
    """Move the finished `tmp` to `output`: into a new or empty folder by one rename, over an
    earlier export of ours by renaming that aside first and carrying the files a user added to it
    into the new one. Anything else there now is refused."""
    check_output(output, where)  # again: the folder may have changed since the start
    marker = tmp / EXPORT_MARKER
    origin = json.loads(marker.read_text()) if marker.is_file() else {}
    marker.write_text(json.dumps(dict(origin, files=_files(tmp)), indent=1) + "\n")
    if output.is_dir() and not any(output.iterdir()):
        output.rmdir()
    if not output.exists():
        os.replace(tmp, output)
        return output
    old = output.with_name(f".{output.name}.old-{os.urandom(4).hex()}")
    os.replace(output, old)
    os.replace(tmp, output)
    kept, left = [], []
    for name in _user_files(old):
        target = output / name
        if target.exists():  # the new export writes a file of that name: the user's stays beside it
            target = target.with_name(target.name + ".before-export")
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(old / name, target)
            kept.append(str(target.relative_to(output)))
        except OSError:
            left.append(name)
    if kept:
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        print(f"{where}: kept {len(kept)} file(s) you added to the earlier export in {output}: {shown}")
    if left:
        print(f"{where}: could not move {len(left)} file(s) you added to the earlier export ({', '.join(left[:5])}): "
              f"they are in {old}, which was not deleted")
    elif is_our_export(old):
        shutil.rmtree(old, ignore_errors=True)
    return output
