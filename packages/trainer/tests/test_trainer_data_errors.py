"""Bad data is one line naming the file (or row) and the fix, never a traceback (issue 13.9)."""

import os
import subprocess
import sys

import pytest

from plait.data import build_dataloader, build_tokenizer
from plait.data.sources import DataError, check_readable

BAD_FILES = {
    # name: (bytes, the part of the message that names the problem, the fix)
    "empty.jsonl": (b"", "has no documents", "at least one row"),
    "empty.txt": (b"", "has no documents", "at least one row"),
    "latin1.txt": ("café\n".encode("latin-1"), "is not UTF-8 text", "iconv"),
    "broken.jsonl": (b'{"text": "ok"}\n{"text": broken\n', "is not valid JSON lines", "data.dataset = 'text'"),
    "body.jsonl": (b'{"body": "x"}\n', "has no column 'text'", "data.text_field"),
}
ROW_ERRORS = {
    "null.jsonl": (b'{"text": "a"}\n{"text": null}\n', "row 1 of", "has no text (null)"),
    "number.jsonl": (b'{"text": 12}\n{"text": "a"}\n', "row 0 of", "has a int text ('12')"),
    "latin1.jsonl": (b'{"text": "ok"}\n{"text": "caf\xe9"}\n', "row 1 of", "is not UTF-8 text"),
}


@pytest.mark.parametrize("name", sorted(BAD_FILES))
def test_unreadable_files_fail_before_the_model(tmp_path, name):
    content, problem, fix = BAD_FILES[name]
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(DataError) as e:
        check_readable("auto", str(path), "train", "text")
    message = str(e.value)
    assert str(path) in message and problem in message and fix in message and "\n" not in message


@pytest.mark.parametrize("name", sorted(ROW_ERRORS))
def test_bad_rows_name_the_row(tmp_path, name):
    content, row, problem = ROW_ERRORS[name]
    path = tmp_path / name
    path.write_bytes(content)
    loader = build_dataloader("json", str(path), build_tokenizer(None), 8, 2, 1, 0, 1, seed=0, split="validation")
    with pytest.raises(DataError) as e:
        next(loader)
    assert f"{row} {path}" in str(e.value) and problem in str(e.value)


def test_a_corpus_of_empty_texts_is_refused(tmp_path):
    """Every text empty: not a run on <|begin_of_text|><|end_of_text|> pairs (fault probe 17)."""
    path = tmp_path / "blank.jsonl"
    path.write_text('{"text": ""}\n' * 5)
    loader = build_dataloader("json", str(path), build_tokenizer(None), 8, 2, 1, 0, 1, seed=0, split="validation")
    with pytest.raises(DataError, match=r"every text of its first \d+ documents is empty"):
        next(loader)


def run_cli(*args):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "plait.trainer", "--training.seq_len", "32",
                           "--training.local_batch_size", "2", *args],
                          capture_output=True, text=True, timeout=120, env=env)


def one_line_error(result, *parts):
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.startswith("plait-train: error")]
    assert len(lines) == 1 and all(p in lines[0] for p in parts), result.stderr[-2000:]


def test_cli_bad_row_and_resume_with_another_seed(tmp_path):
    rows = tmp_path / "rows.jsonl"
    rows.write_bytes(b'{"text": "a"}\n' * 3 + b'{"text": null}\n')
    # The first row is fine, so validation passes; the null row stops the run at step 1.
    one_line_error(run_cli("--data.dataset", "json", "--data.dataset_path", str(rows), "--training.steps", "2",
                           "--job.dump_folder", str(tmp_path / "a")),
                   "at step 1", "has no text (null)", str(rows))
    dump = str(tmp_path / "b")
    first = run_cli("--training.steps", "1", "--checkpoint.enable", "true", "--job.dump_folder", dump)
    assert first.returncode == 0, first.stderr[-2000:]
    one_line_error(run_cli("--training.steps", "2", "--checkpoint.enable", "true", "--job.dump_folder", dump,
                           "--job.seed", "7"),
                   "resuming at step 1", "--job.seed 0")
