"""What the producer holds: engine capacity in samples, and the prompts it works on."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from rollstream.common.models import Prompt

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
