"""Cancellation that survives the libraries under it.

Python 3.11's ``asyncio.wait_for`` (which redis-py uses to send every command) loses a
cancellation that lands just as the wrapped call finishes: the command's reply is read and
returned as if nothing happened (about half the cancellations of a running Redis call, measured
in the commit that added :func:`cancel_requests`). Other redis-py versions turn a cancellation
into a ``ConnectionError`` (they drop the connection when cancelled mid-reply), which a retry
loop would take for an outage and send again. Either way the task's ``cancelling()`` count still
says it was cancelled, so a retry loop marks it on entry (:func:`cancel_requests`) and asks
:func:`raise_if_cancelled` after each attempt, the failed ones before retrying: a cancelled
call is never retried and its ``CancelledError`` reaches the caller.

:func:`being_cancelled` tells a real cancellation from a ``CancelledError`` that user code raised
by itself.
"""

from __future__ import annotations

import asyncio


def cancel_requests() -> int:
    """The current task's count of cancellations requested and not withdrawn (0 outside a task).
    Taken when a retry loop starts, it is the mark :func:`raise_if_cancelled` compares against:
    code already running under a cancellation (cleanup in a ``finally``) still gets its retries,
    only a cancellation that arrives while the loop runs ends it."""
    task = asyncio.current_task()
    return task.cancelling() if task is not None else 0


def being_cancelled() -> bool:
    """Whether the current task has a cancellation requested (and not withdrawn)."""
    return cancel_requests() > 0


def raise_if_cancelled(since: int = 0, *, cause: BaseException | None = None) -> None:
    """Raise :class:`asyncio.CancelledError` if the current task was cancelled (more times than
    ``since``, a mark from :func:`cancel_requests`), even when the cancellation was swallowed on
    the way or came out as ``cause`` (a connection error the cancellation caused)."""
    if cancel_requests() > since:
        raise asyncio.CancelledError() from cause
