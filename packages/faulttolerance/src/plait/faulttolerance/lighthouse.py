"""The lighthouse in a Python process: what a test or a one-file example starts instead of the
`torchft_lighthouse` command (same server, same settings)."""

from __future__ import annotations

from torchft._torchft import LighthouseServer


def start_lighthouse(min_replicas: int = 1, bind: str = "[::]:0", join_timeout_ms: int = 10_000,
                     quorum_tick_ms: int = 100, heartbeat_timeout_ms: int = 5_000) -> LighthouseServer:
    """Start a lighthouse; `.address()` is the `http://HOST:PORT` every group's config names,
    `.shutdown()` stops it.

    bind: `[::]:0` takes any free port (the command's default is 29510).
    join_timeout_ms: how long a new quorum waits for groups that heartbeat but have not asked yet.
    heartbeat_timeout_ms: how long after its last heartbeat a group counts as lost; a step that
    lost a group waits about this long before the survivors' quorum forms."""
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)
