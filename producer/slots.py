"""Slots: a weighted counting semaphore with counters (:class:`Slots`), held per use by :class:`Hold`.
The episode runtime's engine slots and its named limits (``--limit``) are slots."""

from __future__ import annotations

import asyncio


class Slots:
    """A weighted counting semaphore with counters: ``busy``, its ``peak``, ``waiting``."""

    def __init__(self, total: int | None) -> None:
        self.total = total
        self.busy = 0
        self.peak = 0
        self.waiting = 0
        self._changed = asyncio.Event()

    async def acquire(self, weight: int = 1) -> None:
        total = self.total
        if total is not None and total - self.busy < min(weight, total):  # only then: wait
            need = min(weight, total)  # a request of n on a smaller cap waits for all of it
            self.waiting += 1
            try:
                while total - self.busy < need:
                    self._changed.clear()
                    await self._changed.wait()
            finally:
                self.waiting -= 1
        self.busy += weight
        if self.busy > self.peak:
            self.peak = self.busy

    def release(self, weight: int = 1) -> None:
        self.busy -= weight
        self._changed.set()

    def hold(self, weight: int = 1) -> Hold:
        """``async with slots.hold(k)``: ``k`` units while inside."""
        return Hold(self, weight)


class Hold:
    """:meth:`Slots.hold` as a plain class (a generator-based context manager costs more per call)."""

    __slots__ = ("_slots", "_weight")

    def __init__(self, slots: Slots, weight: int) -> None:
        self._slots = slots
        self._weight = weight

    async def __aenter__(self) -> None:
        await self._slots.acquire(self._weight)

    async def __aexit__(self, *exc: object) -> None:
        self._slots.release(self._weight)
