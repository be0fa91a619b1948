"""Which engine of the fleet a request goes to, and the wait for room when none has any.

Requests that carry a key (a group's, and so every turn of its episodes) go to the
engine a consistent-hash ring names for it, unless that engine would then hold more than
``(1 + balance)`` x the mean load of the usable engines (plus :data:`AFFINITY_SLACK` samples:
consistent hashing with bounded loads, Mirrokni et al.): then the next one clockwise. The
samples of a group and the turns of an episode meet their prefix cache; no engine runs far above
the others. Requests without a key go to the least-loaded usable engine. With adaptive
concurrency (:mod:`.load`) an engine at its in-flight limit is skipped like a full one; when every
routed engine is at its limit, requests wait in the client (:meth:`Router.wait_room`, first come
first served) for one to end.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import hashlib
import math
import random
import zlib
from collections import deque
from collections.abc import Iterable, Mapping

from .engine_state import Engine

RING_POINTS = 64
"""Points per engine on the hash ring, at least (spreads keys evenly over many engines)."""
RING_SIZE = 4096
"""Points on the ring of a small fleet: ``RING_SIZE // engines`` each, so two engines' shares of
the keys differ by a few per cent rather than ten (three runs of the bench's cache part: two
engines' prefix hit rate 0.99-1.0x one engine's, against 0.94-0.99x with 64 points each)."""
AFFINITY_SLACK = 8
"""Samples an engine may hold above the bounded load for its keys: at a light load the bound
alone would split every group (a first request sees a mean of 0.5); a group of up to 8 stays
together, and under load the slack is small beside ``balance`` x the mean."""


def _point(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


class Router:
    """The ring of a fleet's engines and the requests waiting for room (no I/O, no states: it
    reads each engine's ``routed``, ``in_flight`` and room)."""

    def __init__(self, engines: Iterable[Engine], *, balance: float, limited: bool) -> None:
        self.balance = balance
        self.limited = limited
        """Adaptive concurrency is on: an engine at its in-flight limit is skipped."""
        self._room_waiters: deque[asyncio.Future[None]] = deque()
        self._ring: list[int] = []
        self._owners: list[Engine] = []
        self.rebuild(engines)

    def rebuild(self, engines: Iterable[Engine]) -> None:
        """The ring of ``engines`` (after one joined or left)."""
        engines = list(engines)
        per_engine = max(RING_POINTS, RING_SIZE // max(1, len(engines)))
        points = sorted((_point(f"{e.url}#{i}"), e.url) for e in engines for i in range(per_engine))
        self._ring = [p for p, _ in points]
        by_url = {e.url: e for e in engines}
        self._owners = [by_url[u] for _, u in points]

    def pick(self, engines: Mapping[str, Engine], key: str | None = None, weight: int = 1) -> Engine | None:
        """The engine for a request of ``weight`` samples (None: no engine is routed, or every
        routed one is at its in-flight limit: see :meth:`wait_room`)."""
        if len(engines) == 1:
            only = next(iter(engines.values()))
            return only if only.routed and only.has_room(weight) else None
        usable = [e for e in engines.values() if e.routed]
        if self.limited:
            usable = [e for e in usable if e.has_room(weight)]
        if not usable:
            return None
        if key is None or len(usable) == 1:
            least = min(e.in_flight for e in usable)
            return random.choice([e for e in usable if e.in_flight == least])
        bound = math.ceil((1 + self.balance) * (sum(e.in_flight for e in usable) + weight) / len(usable))
        bound += AFFINITY_SLACK
        ring, owners = self._ring, self._owners
        start = bisect.bisect(ring, zlib.crc32(key.encode()) << 32 | zlib.adler32(key.encode()))
        seen: set[str] = set()
        for i in range(len(ring)):
            engine = owners[(start + i) % len(ring)]
            if engine.url in seen or not engine.routed or not engine.has_room(weight):
                continue
            if engine.in_flight + weight <= bound:
                return engine
            seen.add(engine.url)
            if len(seen) == len(usable):
                break
        return min(usable, key=lambda e: e.in_flight)

    async def wait_room(self, seconds: float, *, again: bool = False) -> bool:
        """Wait (at most ``seconds``) for a request to end while every routed engine is at its
        limit; first come first served (``again``: woken before and beaten to the room, so first
        in line). True when woken, False on the timeout."""
        waiter = asyncio.get_running_loop().create_future()
        if again:
            self._room_waiters.appendleft(waiter)
        else:
            self._room_waiters.append(waiter)
        try:
            async with asyncio.timeout(seconds):
                await waiter
            return True
        except TimeoutError:
            return False
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.room_freed()  # woken, then cancelled: the next in line gets the room
            raise
        finally:
            if not waiter.done():
                waiter.cancel()
            with contextlib.suppress(ValueError):
                self._room_waiters.remove(waiter)

    def room_freed(self) -> None:
        """A request ended (or a limit rose): the first request waiting for room tries again."""
        waiters = self._room_waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def room_opened(self) -> None:
        """Limits rose or engines changed: every request waiting for room tries again."""
        waiters, self._room_waiters = self._room_waiters, deque()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    @property
    def waiting_for_room(self) -> int:
        return len(self._room_waiters)
