"""plait-train's messages: the `plait.trainer` logger and one rank-aware handler.

Every message is one line, `plait-train: [warning: |error: ][rank N: ]<message>`:
- rank 0 writes it, unless it is logged with `extra=EVERY_RANK` (a rank's own news: then every
  rank writes it, naming itself);
- the run's messages (and plait-checkpoint's, as `checkpoint: ...`) go to stdout, with the
  metrics lines; those of `plait.trainer.cli` (the front: the launcher's summary, the exit's
  reason, errors) go to stderr, where a batch script or torchrun's log collects them.
Standard logging otherwise: `logging.getLogger("plait.trainer").setLevel(logging.WARNING)` keeps
only warnings and errors; replace `HANDLER` to send the lines elsewhere.
"""

import logging
import os
import sys

EVERY_RANK = {"every_rank": True}

_LEVEL_PREFIX = {logging.WARNING: "warning: ", logging.ERROR: "error: ", logging.CRITICAL: "error: "}


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankHandler(logging.Handler):
    """Writes rank 0's records (and EVERY_RANK records of any rank) as plait-train lines. The stream
    is looked up at each write, so a redirected sys.stdout / sys.stderr (a test's capture) is used."""

    def __init__(self, stream_name: str, topic: str = ""):
        super().__init__()
        self.stream_name, self.topic = stream_name, topic

    def emit(self, record: logging.LogRecord) -> None:
        rank = _rank()
        every = getattr(record, "every_rank", False)
        if rank != 0 and not every:
            return
        try:
            where = f"rank {rank}: " if every else ""
            line = f"plait-train: {_LEVEL_PREFIX.get(record.levelno, '')}{where}{self.topic}{record.getMessage()}"
            stream = getattr(sys, self.stream_name)
            stream.write(line + "\n")
            stream.flush()
        except Exception:
            self.handleError(record)


def _logger(name: str, stream_name: str, topic: str = "") -> logging.Logger:
    logger = logging.getLogger(name)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # a root handler (the user's basicConfig) would print each line twice
    if not any(isinstance(h, RankHandler) for h in logger.handlers):
        logger.addHandler(RankHandler(stream_name, topic))
    return logger


log = _logger("plait.trainer", "stdout")
cli_log = _logger("plait.trainer.cli", "stderr")
# plait-checkpoint's CheckpointWriter logs its saves there; in a run they are plait-train lines too.
_logger("plait.checkpoint", "stdout", topic="checkpoint: ")
HANDLER = log.handlers[0]
