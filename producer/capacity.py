"""What the producer holds: engine capacity in samples, the prompts it works on, and the
:class:`WorkTable` that owns them (the worker, the reclaim pass and the drain share it)."""

from __future__ import annotations

import asyncio
import contextlib
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from rollstream.common.connection import Outage
from rollstream.common.logs import Prefixed
from rollstream.common.models import Prompt
from rollstream.common.protocol import Admitted

from .renewal import Renewer
from .warm import Prepared


class Capacity:
    """Engine capacity in samples: taken ``n`` at a time for a prompt, given back per sample.

    Single-threaded (the event loop): :meth:`give` is synchronous so a finishing sample releases
    its unit at once; waiters re-check on every change (an Event, set on each give)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._changed = asyncio.Event()

    async def room(self, samples: int, stopping: asyncio.Event) -> bool:
        """Wait until ``samples`` units are free (True) or ``stopping`` is set (False)."""
        while self.free < samples:
            if stopping.is_set():
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._changed.wait()
        return True

    async def take(self, samples: int, stopping: asyncio.Event) -> bool:
        """Take ``samples`` units when they are free; False (nothing taken) once stopping."""
        if not await self.room(samples, stopping):
            return False
        self.free -= samples
        return True

    def give(self, samples: int) -> None:
        self.free += samples
        self.wake()

    def wake(self) -> None:
        self._changed.set()


@dataclass(slots=True)
class Work:
    stream: str
    """The prompt stream the entry belongs to (``prompts`` or ``retry``)."""
    prompt_id: bytes
    fields: dict[bytes, bytes]
    version: int
    """The trainer's weight version when the prompt was admitted (or taken over)."""
    prompt: Prompt | None = None
    task: asyncio.Task[None] | None = None
    lease_lost: bool = False
    finishing: bool = False
    """Its last script (publish, dead letter, return) is under way: that script's XACK says
    whether the lease held, so a renewal that finds the entry gone is no loss."""
    held: int = 0
    """Capacity units (samples) this prompt still holds."""
    prepared: Prepared | None = None
    """Warm pools: its episodes' prepared resources (released if unused when it is dropped)."""
    warming: bool = False
    """Admitted beyond the concurrency (``--warm``): its prepare runs while it waits for room."""


class WorkTable:
    """The work in flight of one producer, owned in one place: the prompts held (their leases
    renewed), the capacity they hold, whether the producer is stopping or failed, and the Redis
    outage its loops ride out. The worker's admission, the reclaim pass and the drain share it
    through these methods; nothing else keeps a list of prompts or a stop flag."""

    def __init__(self, concurrency: int, outage: Outage, log: Prefixed, warm: int = 0) -> None:
        self.capacity = Capacity(concurrency)
        self.outage = outage
        """The producer's Redis outage: every loop's turn rides it out, and a recovery ends it."""
        self.log = log
        self.stopping = asyncio.Event()
        """Set by :meth:`stop` or :meth:`fail`: nothing more is admitted or taken over."""
        self.woken = asyncio.Event()
        """Set by :meth:`wake` (a control message, a stop, a finished reclaim): admission looks again."""
        self.state = "starting"
        """What the heartbeat reports: starting, running, draining, stopped or failed."""
        self.fatal: BaseException | None = None
        """The first fatal error (:meth:`fail`); the drain records it and the producer raises it."""
        self.fatal_tb = ""
        """Its traceback, recorded with it in ``events``."""
        self.warm = warm
        """Warm pools: prompts admitted beyond the concurrency (the generate function has a prepare hook)."""
        self.warming: set[bytes] = set()
        """The warm prompts still waiting for room."""
        self.warm_changed = asyncio.Event()
        self.renewer: Renewer | None = None
        """The lease renewal thread, once started: it renews what is held."""
        self.runner: Callable[[Work], Coroutine[Any, Any, None]] | None = None
        """What runs one prompt (the worker's), set before anything is started."""
        self.published = 0
        self.duplicates = 0
        """Groups discarded because another producer had taken the prompt over."""
        self.reclaimed = 0
        """Prompts taken over from another producer after their lease."""
        self.returned = 0
        """Prompts given back to the retry stream by the drain."""
        self._held: dict[bytes, Work] = {}
        self._abandoned: set[asyncio.Task[Any]] = set()

    # -- what is held -------------------------------------------------------------------

    def __contains__(self, prompt_id: object) -> bool:
        return prompt_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def get(self, prompt_id: bytes) -> Work | None:
        return self._held.get(prompt_id)

    def works(self) -> list[Work]:
        """The prompts held now (a copy: the caller may drop them meanwhile)."""
        return list(self._held.values())

    def tasks(self) -> list[asyncio.Task[None]]:
        """The tasks of the prompts held that have one (a prompt taken over while stopping has none)."""
        return [w.task for w in self._held.values() if w.task is not None]

    @property
    def in_flight_samples(self) -> int:
        return self.capacity.total - self.capacity.free

    def start(self, item: Admitted, version: int, n: int, *, warming: bool = False) -> None:
        """Run a prompt whose ``n`` units of capacity were just taken (``warming``: none yet, its
        task takes them once its prepare hook started)."""
        if self.runner is None:
            raise RuntimeError("WorkTable.start before its runner was set (the producer sets it when it is made)")
        work = Work(
            stream=item.stream, prompt_id=item.entry_id, fields=item.fields, version=version,
            held=0 if warming else n, warming=warming,
        )
        if warming:
            self.warming.add(work.prompt_id)
        self.hold(work)
        work.task = asyncio.create_task(self.runner(work), name=f"work-{item.entry_id.decode()}")

    def hold(self, work: Work) -> None:
        """List a prompt as held: its lease is renewed until :meth:`drop`."""
        self._held[work.prompt_id] = work
        if self.renewer is not None:
            self.renewer.hold(work.stream, work.prompt_id)

    def claiming(self) -> contextlib.AbstractContextManager[None]:
        """Around a call that claims prompts (ADMIT, XAUTOCLAIM, adoption) until they are held."""
        return self.renewer.claiming() if self.renewer is not None else contextlib.nullcontext()

    def drop(self, work: Work) -> None:
        """A prompt's last script returned: no longer held, no longer renewed. (Renewing goes on
        until then: the loop may stall between the call and the script, see :mod:`.renewal`.)"""
        self._held.pop(work.prompt_id, None)
        self.done_warming(work)
        if self.renewer is not None:
            self.renewer.release(work.prompt_id)

    def done_warming(self, work: Work) -> None:
        if work.prompt_id in self.warming:
            self.warming.discard(work.prompt_id)
            self.warm_changed.set()

    def sample_done(self, work: Work, samples: int) -> None:
        """Give back the units of finished samples, keeping one until the group is published."""
        units = min(samples, work.held - 1)
        if units > 0:
            work.held -= units
            self.capacity.give(units)

    def give_back_units(self, work: Work) -> None:
        """The prompt's task ended: every unit it still holds is free."""
        self.capacity.give(work.held)
        work.held = 0

    async def release_prepared(self, work: Work) -> None:
        """Release the prepared resources no episode of ``work`` took (warm pools)."""
        if work.prepared is not None:
            released = await work.prepared.release_unused()
            if released:
                self.log.debug("released %d unused prepared resource(s) of prompt entry %s",
                               released, work.prompt_id.decode())

    # -- stopping -----------------------------------------------------------------------

    def wake(self) -> None:
        self.woken.set()

    def stop(self) -> None:
        """Stop admitting and taking over; wake whatever waits for room or news."""
        self.stopping.set()
        self.woken.set()
        self.capacity.wake()

    def fail(self, exc: BaseException) -> None:
        """A fatal error: the first is kept (with its traceback), and the producer stops."""
        if self.fatal is None:
            self.fatal = exc
            self.fatal_tb = "".join(traceback.format_exception(exc))
            self.log.error("fatal error: %s", exc)
        self.stop()

    def leave_behind(self, task: asyncio.Task[Any]) -> None:
        """Keep a reference to a task that did not end after its cancellation, until it does."""
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)
