"""`declared_sync("why")`: runtime code that blocks the host on purpose says so. Free outside a
test; plait-testing's StepSentinel still counts such a sync and names the reason."""

import contextlib
import threading

_local = threading.local()


@contextlib.contextmanager
def declared_sync(reason: str):
    """Mark the host syncs inside as intended (still counted); free when no sentinel is entered."""
    stack = _local.__dict__.setdefault("declared", [])
    stack.append(reason)
    try:
        yield
    finally:
        stack.pop()


def current_reason() -> str | None:
    """The innermost declared reason on this thread, or None."""
    stack = _local.__dict__.get("declared")
    return stack[-1] if stack else None
