"""What each rank was doing when it failed, for the launcher's one line about who failed first.

A collective that times out fails on the ranks that waited, not on the rank that stalled (a
SIGSTOP, a hung device, a swapping host): that one fails last, when the launcher kills it, and
looked like the culprit of nothing (or of "the OOM killer"). So every rank that fails notes its
step and cause in `<dump_folder>/.plait-ranks/rank-N.json`; the launcher reads the notes: the
ranks that timed out waited, and a rank killed without a note is the one they waited on.
"""

import json
import os
import time
from pathlib import Path

FOLDER = ".plait-ranks"
TIMEOUT = "collective timeout"


def cause_of(error: BaseException) -> str:
    text = str(error).lower()
    if "timed out" in text or "timeout" in text:
        return TIMEOUT
    return type(error).__name__


def note_failure(dump_folder: str, rank: int, step: int, error: BaseException) -> None:
    try:
        folder = Path(dump_folder) / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".rank-{rank}.json.tmp"
        tmp.write_text(json.dumps({"step": int(step), "cause": cause_of(error), "time": time.time()}))
        os.replace(tmp, folder / f"rank-{rank}.json")
    except OSError:
        pass  # a note must never hide the failure itself


def read_notes(dump_folder: str, since: float = 0.0) -> dict[int, dict]:
    """rank -> its note, for the notes written at or after `since` (this run's)."""
    out = {}
    try:
        files = list((Path(dump_folder) / FOLDER).glob("rank-*.json"))
    except OSError:
        return out
    for file in files:
        try:
            note = json.loads(file.read_text())
            if note.get("time", 0) >= since:
                out[int(file.stem.split("-", 1)[1])] = note
        except (OSError, ValueError):
            continue
    return out
