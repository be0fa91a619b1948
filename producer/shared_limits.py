"""Namespace-wide limits and rates as a producer's episodes hold them (``async with
episode.limit(NAME)``, ``await episode.rate(NAME)``).

A unit of a limit is leased in Redis (LIMIT_ACQUIRE) and renewed with the producer's other
leases, so a killed producer's units come back within the namespace's lease. A limit or rate
removed by ``rollstream limits remove`` leaves a mark that the next try reads: its waiters go on
at once (as they would see a size raised by ``limits set``), unlimited. Waiting polls
(every :data:`POLL_MIN` to :data:`POLL_MAX` seconds, so a unit given back or a size raised at
runtime is seen within half a second) and holds no engine slot; it runs inside the episode, so
it counts against its deadline. The sizes the producer last read stand in for a ``limits`` hash
that is gone (a Redis restarted without persistence): nothing deadlocks and nothing crashes, and
the holders' set, gone too, starts empty. A Redis that cannot be reached while an episode waits
is retried at the same pace (the episode deadline bounds the wait).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from rollstream.common.cancellation import cancel_requests, raise_if_cancelled
from rollstream.common.connection import TRANSIENT_ERRORS
from rollstream.common.logs import Prefixed
from rollstream.common.protocol import NamespaceLimits

logger = logging.getLogger(__name__)

POLL_MIN = 0.02
POLL_MAX = 0.5
"""Seconds between two tries for a unit (doubling from ``POLL_MIN``) or a rate token (at most)."""
WAIT_LEASE_S = 10.0
"""A waiter for a unit keeps its place in line while it asks again within this (it asks every
:data:`POLL_MAX` at most): a killed producer's waiters stop holding the line after it."""


class SharedLimits:
    """One producer's view of its namespace's limits and rates."""

    def __init__(self, limits: NamespaceLimits, producer: str, lease_s: float) -> None:
        self.store = limits
        self.producer = producer
        self.log = Prefixed(logger, "producer", producer)
        self.lease_ms = int(lease_s * 1000)
        self.sizes: dict[str, int] = {}
        self.rates: dict[str, float] = {}
        self.removed: set[str] = set()
        """Names removed by ``rollstream limits remove``: no longer applied (not an unknown name)."""
        self.held: dict[str, set[str]] = {}
        """Limit name -> this producer's tokens holding a unit (renewed by :meth:`renew`)."""
        self.waiting = 0
        self.lost = 0
        """Units whose lease lapsed while held (the loop or the network stalled past the lease)."""

    async def refresh(self) -> None:
        """Read the sizes (at start and every heartbeat: ``rollstream limits set`` at runtime);
        a hash that is gone keeps the sizes last read."""
        sizes, rates, removed = await self.store.read()
        if not sizes and not rates and not removed and (self.sizes or self.rates):
            self.log.warning("the namespace limits hash is gone (Redis restarted?); keeping the last sizes read: %s",
                             {**self.sizes, **self.rates})
            return
        self.sizes, self.rates, self.removed = sizes, rates, removed

    def is_removed(self, name: str) -> bool:
        """Whether ``name`` was removed (``limits remove``): an episode's ``limit`` / ``rate`` of it
        goes on unlimited, as it would have at its next try in Redis."""
        return name in self.removed

    def _removed(self, name: str, kind: str) -> None:
        if name not in self.removed:
            self.log.info("namespace %s %s was removed (rollstream limits remove): no longer applied", kind, name)
        self.removed.add(name)
        if kind == "limit":
            self.sizes.pop(name, None)
        else:
            self.rates.pop(name, None)

    def has_limit(self, name: str) -> bool:
        return name in self.sizes

    def has_rate(self, name: str) -> bool:
        return name in self.rates

    @contextlib.asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        """One unit of limit ``name`` across every producer of the namespace while inside."""
        token = f"{self.producer}:{uuid.uuid4().hex[:12]}"
        started = time.monotonic()
        pause = POLL_MIN
        mark = cancel_requests()
        self.waiting += 1
        try:
            while True:
                waited_ms = int((time.monotonic() - started) * 1000)
                try:
                    status, _ = await self.store.acquire(
                        name, token, self.lease_ms, self.sizes.get(name, 0), waited_ms,
                        min(self.lease_ms, int(WAIT_LEASE_S * 1000)),
                    )
                except TRANSIENT_ERRORS as exc:
                    raise_if_cancelled(mark, cause=exc)  # a cancellation, not an outage: not asked again
                    logger.debug("limit %s: Redis unreachable while waiting (%s); retrying", name, exc)
                    status = "wait"
                raise_if_cancelled(mark)  # one redis-py lost: the unit, if acquired, is released below
                if status == "ok":
                    break
                if status == "removed":  # `limits remove` while it waited: no unit to hold any more
                    self._removed(name, "limit")
                    break
                if status == "unknown":
                    raise KeyError(f"no namespace limit named {name!r} (rollstream limits set --ns NS {name}=K)")
                await asyncio.sleep(pause)
                pause = min(POLL_MAX, pause * 2)
        except BaseException:
            with contextlib.suppress(*TRANSIENT_ERRORS):
                await asyncio.shield(self.store.release(name, token))  # no longer waiting
            raise
        finally:
            self.waiting -= 1
        if status == "removed":
            yield
            return
        self.held.setdefault(name, set()).add(token)
        try:
            yield
        finally:
            self.held[name].discard(token)
            with contextlib.suppress(*TRANSIENT_ERRORS):  # else its lease lapses: it comes back all the same
                await asyncio.shield(self.store.release(name, token))

    async def take(self, name: str) -> None:
        """One token of rate ``name``, shared by every producer of the namespace."""
        started = time.monotonic()
        mark = cancel_requests()
        while True:
            waited_ms = int((time.monotonic() - started) * 1000)
            try:
                status, wait_ms = await self.store.take(name, self.rates.get(name, 0.0), waited_ms)
            except TRANSIENT_ERRORS as exc:
                raise_if_cancelled(mark, cause=exc)
                logger.debug("rate %s: Redis unreachable while waiting (%s); retrying", name, exc)
                status, wait_ms = "wait", int(POLL_MAX * 1000)
            raise_if_cancelled(mark)
            if status == "ok":
                return
            if status == "removed":
                self._removed(name, "rate")
                return
            if status == "unknown":
                raise KeyError(f"no namespace rate named {name!r} (rollstream limits set --ns NS --rate {name}=R/s)")
            self.waiting += 1
            try:
                await asyncio.sleep(min(POLL_MAX, max(POLL_MIN, wait_ms / 1000)))
            finally:
                self.waiting -= 1

    async def renew(self) -> None:
        """Extend the leases of the units held (with the producer's prompt leases)."""
        for name, tokens in list(self.held.items()):
            if not tokens:
                continue
            lost = await self.store.renew(name, sorted(tokens), self.lease_ms)
            if lost:
                self.lost += len(lost)
                self.log.warning("%d unit(s) of limit %s lapsed past the %.0f s lease while held",
                                 len(lost), name, self.lease_ms / 1000)

    def stats(self) -> dict[str, Any]:
        return {"held": sum(len(t) for t in self.held.values()), "waiting": self.waiting, "lost": self.lost}
