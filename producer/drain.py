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
from typing import Any, Protocol

from redis.asyncio import Redis
from rollstream.common.connection import TRANSIENT_ERRORS
from rollstream.common.events import DRAIN, FATAL, STOP, record_event
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.protocol import PromptQueue

from .capacity import Work, WorkTable
from .settings import ProducerSettings

TASK_EXIT_TIMEOUT = 5.0
"""Seconds the runtime waits for cancelled tasks to end before it abandons them (logged)."""


class Beat(Protocol):
    async def write(self) -> None: ...


class Draining(Protocol):
    """What the drain reads of its producer (:class:`~.worker.Producer`): public members only."""

    @property
    def table(self) -> WorkTable: ...
    @property
    def name(self) -> str: ...
    @property
    def redis(self) -> Redis: ...
    @property
    def keys(self) -> Keys: ...
    @property
    def log(self) -> Prefixed: ...
    @property
    def settings(self) -> ProducerSettings: ...
    @property
    def prompts(self) -> PromptQueue: ...
    @property
    def pulse(self) -> Beat: ...


async def shutdown(p: Draining) -> None:
    """Drain (or, after a fatal error, stop at once), return what is held, record how it ended."""
    table = p.table
    work_tasks = table.tasks()
    if table.fatal is None:
        table.state = "draining"
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
        table.state = "failed"
    await cancel_and_wait(table, work_tasks, "work")
    await return_unfinished(table, p.prompts)
    fatal = table.fatal
    if fatal is not None:
        await table.outage.run(
            lambda: record_event(
                p.redis, p.keys, FATAL, source=p.name,
                message=f"{type(fatal).__name__}: {fatal}", traceback=table.fatal_tb,
            ),
            give_up_after=30,
        )
    else:
        table.state = "stopped"
        with contextlib.suppress(*TRANSIENT_ERRORS):
            await record_event(
                p.redis, p.keys, STOP, source=p.name,
                message=f"published {table.published}, returned {table.returned}",
            )
    with contextlib.suppress(*TRANSIENT_ERRORS):
        await p.pulse.write()
    p.log.info(
        "%s: published %d groups, returned %d prompts, discarded %d duplicates",
        table.state, table.published, table.returned, table.duplicates,
    )


async def return_unfinished(table: WorkTable, prompts: PromptQueue) -> None:
    """Put the prompts still held into the retry stream, with their attempt unchanged."""
    for work in table.works():
        try:
            returned = await table.outage.run(functools.partial(_give_back, prompts, work), give_up_after=30)
        except TRANSIENT_ERRORS:
            table.log.error(
                "could not return prompt entry %s; it will be reclaimed after the lease",
                work.prompt_id.decode(),
            )
            continue
        if returned:
            table.returned += 1
        table.drop(work)
        await table.release_prepared(work)


async def _give_back(prompts: PromptQueue, work: Work) -> bool:
    work.finishing = True
    return await prompts.give_back(work.stream, work.prompt_id, work.fields)


async def cancel_and_wait(table: WorkTable, tasks: list[asyncio.Task[Any]], what: str) -> None:
    """Cancel ``tasks`` and wait for them, at most :data:`TASK_EXIT_TIMEOUT` seconds: one
    that does not end (a library swallowed its cancellation) is logged and left behind,
    referenced, rather than hanging the shutdown."""
    for task in tasks:
        task.cancel()
    if not tasks:
        return
    _, pending = await asyncio.wait(tasks, timeout=TASK_EXIT_TIMEOUT)
    for task in pending:
        table.leave_behind(task)
        table.log.warning(
            "%s task %s did not end %.0f s after its cancellation; left behind",
            what, task.get_name(), TASK_EXIT_TIMEOUT,
        )
