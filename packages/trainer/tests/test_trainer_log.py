"""plait-train's messages go through logging: one line each, `plait-train: [warning: |error: ]
[rank N: ]...`, rank 0's only unless logged for every rank, the run's on stdout and the front's on
stderr, plait-checkpoint's as `checkpoint: ...`; a user's logging settings apply."""

import logging

from plait.trainer.log import EVERY_RANK, cli_log, log


def test_levels_streams_and_the_checkpoint_topic(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    log.info("step news")
    log.warning("something odd")
    cli_log.error("bad setting")
    logging.getLogger("plait.checkpoint").info("saved step-000001")
    out, err = capsys.readouterr()
    assert out.splitlines() == [
        "plait-train: step news",
        "plait-train: warning: something odd",
        "plait-train: checkpoint: saved step-000001",
    ]
    assert err.splitlines() == ["plait-train: error: bad setting"]


def test_only_rank_0_writes_unless_every_rank_is_asked(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "3")
    log.info("once for the run")
    log.info("waited for data", extra=EVERY_RANK)
    cli_log.error("out of memory", extra=EVERY_RANK)
    out, err = capsys.readouterr()
    assert out.splitlines() == ["plait-train: rank 3: waited for data"]
    assert err.splitlines() == ["plait-train: error: rank 3: out of memory"]


def test_the_users_level_applies(capsys, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    logger = logging.getLogger("plait.trainer")
    logger.setLevel(logging.WARNING)
    try:
        log.info("progress")
        log.warning("kept")
    finally:
        logger.setLevel(logging.INFO)
    assert capsys.readouterr().out.splitlines() == ["plait-train: warning: kept"]
