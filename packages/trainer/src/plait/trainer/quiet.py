"""Other libraries' messages that drown plait-train's lines and say nothing to its users, dropped
at plait's entry points only (plait-train, plait-plan): a library user's own program keeps them.

Each is matched by its logger (or warning category) and its text, so a new message from the same
place still shows. What plait itself caused is fixed where it is caused, not filtered here.
"""

import logging
import os

# (logger, a fragment of the message) of the known harmless ones
_LOGGED = (
    # torchao's optional CUDA kernels, absent from a CPU build: float8 runs torchao's emulation there
    ("torchao", "Failed to load"),
    # torch 2.13 on torchao 0.18's Enum registrations: a deprecation for torchao to act on
    ("torch.utils._pytree", "is an Enum subclass and is now natively supported"),
)


class _Drop(logging.Filter):
    def __init__(self, fragment: str):
        super().__init__()
        self.fragment = fragment

    def filter(self, record: logging.LogRecord) -> bool:
        return self.fragment not in record.getMessage()


def quiet_known_noise() -> None:
    """Install the filters (idempotent)."""
    for name, fragment in _LOGGED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and f.fragment == fragment for f in logger.filters):
            logger.addFilter(_Drop(fragment))


def one_openmp_thread_per_rank() -> None:
    """For the ranks plait-train launches: torch's launcher sets OMP_NUM_THREADS=1 itself when it
    is unset, with a four-line warning saying so; plait.mesh sets each rank's intra-op threads
    from the cores either way."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
