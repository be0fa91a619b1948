"""Cancellation that survives the libraries under it.

Python 3.11's ``asyncio.wait_for`` (which redis-py uses to send a command, e.g. during a
connection's handshake) loses a cancellation that lands just as the wrapped call finishes. A
loop that checks :func:`raise_if_cancelled` once per turn ends at its next turn whatever the
libraries under it did; :func:`being_cancelled` tells a real cancellation from a
``CancelledError`` that user code raised by itself.
"""

from __future__ import annotations

import asyncio


def being_cancelled() -> bool:
    """Whether the current task has a cancellation requested (and not withdrawn)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def raise_if_cancelled() -> None:
    """Raise :class:`asyncio.CancelledError` if the current task was cancelled, even when the
    cancellation was swallowed on the way."""
    if being_cancelled():
        raise asyncio.CancelledError
