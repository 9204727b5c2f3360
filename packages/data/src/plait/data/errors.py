"""The data package's error type: a leaf module, imported by every reader and by the trainer."""

from __future__ import annotations


class DataError(ValueError):
    """Data that cannot be trained on; the message names the file (or row) and the fix."""


def read_error(e: BaseException, name: str) -> DataError:
    """One line for a failure to read `name`, from the root cause `datasets` wraps."""
    causes = [e]
    while causes[-1].__cause__ or causes[-1].__context__:
        causes.append(causes[-1].__cause__ or causes[-1].__context__)
    kinds = {type(c).__name__ for c in causes}
    if "UnicodeDecodeError" in kinds:
        u = next(c for c in causes if isinstance(c, UnicodeDecodeError))
        return DataError(f"{name} is not UTF-8 text (byte {u.object[u.start:u.start + 1]!r} at offset {u.start} "
                         "of a block): re-encode it as UTF-8, e.g. iconv -f latin1 -t utf-8")
    if "ArrowInvalid" in kinds and any("JSON" in str(c) for c in causes):
        first = next(str(c) for c in causes if "JSON" in str(c)).splitlines()[0]
        return DataError(f"{name} is not valid JSON lines ({first}): fix that line, or read the file "
                         "as plain text with data.dataset = 'text'")
    if kinds & {"StopIteration", "SchemaInferenceError"}:
        return DataError(f"{name} has no documents: give a file with at least one row")
    root = causes[-1]
    return DataError(f"{name} could not be read: {type(root).__name__}: {str(root).strip().splitlines()[0] if str(root).strip() else ''}")
