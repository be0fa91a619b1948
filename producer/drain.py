"""The producer's end: the drain after SIGTERM/SIGINT (:meth:`~.worker.Producer.stop`) or a fatal
error, and the prompts still held given back to the stream.

A drain stops admitting, waits up to ``drain_timeout`` for the groups in flight, cancels what is
left and returns those prompts to the retry stream with their attempt unchanged (a prompt that
cannot be returned is reclaimed after its lease). A fatal error skips the wait and is recorded in
``events`` with its traceback. The heartbeat says ``draining``, then ``stopped`` or ``failed``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
from typing import TYPE_CHECKING, Any

from rollstream.common.connection import TRANSIENT_ERRORS
from rollstream.common.events import DRAIN, FATAL, STOP, record_event

from .capacity import Work

if TYPE_CHECKING:
    from .worker import Producer

TASK_EXIT_TIMEOUT = 5.0
"""Seconds the runtime waits for cancelled tasks to end before it abandons them (logged)."""


async def shutdown(p: Producer) -> None:
    """Drain (or, after a fatal error, stop at once), return what is held, record how it ended."""
    work_tasks = [w.task for w in p._work.values() if w.task is not None]
    if p._fatal is None:
        p._state = "draining"
        p.log.info(
            "draining %d prompts (up to %.0f s)",
            len(work_tasks), p.settings.drain_timeout,
        )
        with contextlib.suppress(Exception):
            await p.pulse.write()
            await record_event(p.redis, p.keys, DRAIN, source=p.name)
        if work_tasks:
            await asyncio.wait(work_tasks, timeout=p.settings.drain_timeout)
    else:
        p._state = "failed"
    await cancel_and_wait(p, work_tasks, "work")
    await return_unfinished(p)
    fatal = p._fatal
    if fatal is not None:
        await p._outage.run(
            lambda: record_event(
                p.redis, p.keys, FATAL, source=p.name,
                message=f"{type(fatal).__name__}: {fatal}", traceback=p._fatal_tb,
            ),
            give_up_after=30,
        )
    else:
        p._state = "stopped"
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await record_event(
                p.redis, p.keys, STOP, source=p.name,
                message=f"published {p.published}, returned {p.returned}",
            )
    with contextlib.suppress(*TRANSIENT_ERRORS):
        await p.pulse.write()
    p.log.info(
        "%s: published %d groups, returned %d prompts, discarded %d duplicates",
        p._state, p.published, p.returned, p.duplicates,
    )


async def return_unfinished(p: Producer) -> None:
    """Put the prompts still held into the retry stream, with their attempt unchanged."""
    for work in list(p._work.values()):
        try:
            returned = await p._outage.run(functools.partial(_give_back, p, work), give_up_after=30)
        except TRANSIENT_ERRORS:
            p.log.error(
                "could not return prompt entry %s; it will be reclaimed after the lease",
                work.prompt_id.decode(),
            )
            continue
        if returned:
            p.returned += 1
        p._drop(work)
        await p._release_prepared(work)


async def _give_back(p: Producer, work: Work) -> bool:
    work.finishing = True
    return await p.prompts.give_back(work.stream, work.prompt_id, work.fields)


async def cancel_and_wait(p: Producer, tasks: list[asyncio.Task[Any]], what: str) -> None:
    """Cancel ``tasks`` and wait for them, at most :data:`TASK_EXIT_TIMEOUT` seconds: one
    that does not end (a library swallowed its cancellation) is logged and left behind,
    referenced, rather than hanging the shutdown."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=TASK_EXIT_TIMEOUT)
    for task in pending:
        p._abandoned.add(task)
        task.add_done_callback(p._abandoned.discard)
        p.log.warning(
            "%s task %s did not end %.0f s after its cancellation; left behind",
            what, task.get_name(), TASK_EXIT_TIMEOUT,
        )
