"""A trainer's hold on its consumer name: taken on connect, renewed while connected, given up on close."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import socket
import time

from redis.asyncio import Redis
from rollstream.common.cancellation import cancel_requests, raise_if_cancelled
from rollstream.common.connection import TRANSIENT_ERRORS
from rollstream.common.errors import ConsumerNameInUse
from rollstream.common.keys import Keys
from rollstream.common.logs import Prefixed
from rollstream.common.protocol import NameLease

from .options import NAME_LEASE_SECONDS

_RELEASE_ERRORS: tuple[type[BaseException], ...] = (TimeoutError, *TRANSIENT_ERRORS)

logger = logging.getLogger(__name__)


class NameHold:
    """The consumer name held by this process (one live trainer per name)."""

    def __init__(self, redis: Redis, keys: Keys, name: str) -> None:
        self.keys = keys
        self.name = name
        self.log = Prefixed(logger, "consumer", name, keys.namespace)
        self.lease = NameLease(redis, keys, name, f"{socket.gethostname()} pid {os.getpid()} {secrets.token_hex(4)}")
        self.lost: ConsumerNameInUse | None = None
        self._task: asyncio.Task[None] | None = None

    async def take(self, wait: float) -> None:
        """Take the name, waiting up to ``wait`` seconds for another holder to go."""
        deadline = time.monotonic() + wait
        announced = False
        while not await self.lease.hold(int(NAME_LEASE_SECONDS * 1000)):
            holder = await self.lease.holder()
            if time.monotonic() >= deadline:
                raise ConsumerNameInUse(
                    self.keys.namespace, self.name, holder, f"still held after waiting {wait:.0f} s"
                )
            if not announced:
                announced = True
                self.log.warning(
                    "the name is held by %s; waiting up to %.0f s for it to be released or expire",
                    holder, wait,
                )
            await asyncio.sleep(min(0.5, max(0.0, deadline - time.monotonic())))

    def keep(self) -> None:
        """Start renewing the hold (a task, until :meth:`release`)."""
        self._task = asyncio.create_task(self._renew(), name=f"rollstream-lease-{self.name}")

    def check(self) -> None:
        """Raise :class:`ConsumerNameInUse` when another trainer took the name from this one."""
        if self.lost is not None:
            raise self.lost

    async def release(self) -> None:
        """Stop renewing and give the name up; best effort: if Redis cannot be reached, the hold
        expires by itself."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait({self._task}, timeout=5)
        try:
            async with asyncio.timeout(2):
                await self.lease.release()
        except _RELEASE_ERRORS as exc:
            self.log.debug("releasing the name lease failed (%s); it expires by itself", exc)

    async def _renew(self) -> None:
        mark = cancel_requests()
        while True:
            raise_if_cancelled(mark)  # one redis-py lost in the last turn
            await asyncio.sleep(NAME_LEASE_SECONDS / 4)
            try:
                if await self.lease.hold(int(NAME_LEASE_SECONDS * 1000)):
                    continue
                holder = await self.lease.holder()
            except TRANSIENT_ERRORS as exc:
                raise_if_cancelled(mark, cause=exc)
                self.log.debug("renewing the name lease failed (%s); retrying", exc)
                continue
            self.lost = ConsumerNameInUse(
                self.keys.namespace, self.name, holder,
                f"this trainer's hold lapsed (Redis unreachable for over {NAME_LEASE_SECONDS:.0f} s?) and another "
                "trainer took the name; this one stops taking and committing",
            )
            logger.error("%s", self.lost)
            return
