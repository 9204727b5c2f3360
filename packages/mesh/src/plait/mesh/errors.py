"""The two failures every plait package reports the same way, so the trainer maps each to one
exit code whichever package raised it (plait-checkpoint's, the trainer's own)."""


class ConfigError(ValueError):
    """A setting that cannot run: one line naming the setting and the fix (`plait-train` exits 2)."""


class InfrastructureFault(Exception):
    """A fault of the machine, not of the run's settings (a write that failed: disk full,
    read-only); one line naming what and where (`plait-train` exits 74, requeue)."""
