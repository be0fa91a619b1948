"""Redis connections and riding out Redis outages.

Two rules from redis-py's behaviour shape this module:

* a blocking read (``XREADGROUP ... BLOCK``) needs a socket timeout *above* its BLOCK time,
  otherwise redis-py times the socket out and silently re-sends the command; blocking readers
  therefore get their own client, made by :func:`connect` with ``block_ms``;
* redis-py's own retry covers a blip; a Redis restart takes longer, so the long-running loops
  wrap their steps in :class:`Outage`, which backs off (bounded), logs once per outage and
  once on recovery.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import BusyLoadingError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from .backoff import Backoff

T = TypeVar("T")

TRANSIENT_ERRORS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    BusyLoadingError,
    ConnectionError,
    OSError,
)
"""Errors that mean "Redis is (briefly) unreachable": retry, do not fail."""


def connect(url: str, *, block_ms: int | None = None, name: str | None = None) -> Redis:
    """A client for ``url``. With ``block_ms``, the socket timeout leaves room for BLOCK."""
    socket_timeout = 10.0 if block_ms is None else block_ms / 1000 + 10.0
    return Redis.from_url(
        url,
        socket_timeout=socket_timeout,
        socket_connect_timeout=5.0,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries=2),
        retry_on_error=[RedisConnectionError, RedisTimeoutError, BusyLoadingError],
        client_name=name,
        decode_responses=False,
    )


class Outage:
    """Tracks one component's view of Redis availability: bounded backoff, one log line each way."""

    def __init__(self, logger: logging.Logger, what: str, *, max_delay: float = 2.0) -> None:
        self._logger = logger
        self._what = what
        self._backoff = Backoff(base=0.05, cap=max_delay)
        self._since: float | None = None
        self._attempt = 0
        self.count = 0

    async def failed(self, exc: BaseException) -> None:
        """Record a failure, log it if it starts an outage, and sleep the backoff."""
        if self._since is None:
            self._since = time.monotonic()
            self.count += 1
            self._logger.warning("%s: lost Redis (%s: %s); reconnecting", self._what, type(exc).__name__, exc)
        self._attempt += 1
        await self._backoff.sleep(self._attempt)

    def recovered(self) -> None:
        if self._since is not None:
            self._logger.warning(
                "%s: Redis is back after %.1f s", self._what, time.monotonic() - self._since
            )
        self._since = None
        self._attempt = 0

    async def run(self, step: Callable[[], Awaitable[T]], *, give_up_after: float | None = None) -> T:
        """Run ``step`` until it succeeds, riding out transient Redis errors."""
        started = time.monotonic()
        while True:
            try:
                result = await step()
            except TRANSIENT_ERRORS as exc:
                if give_up_after is not None and time.monotonic() - started > give_up_after:
                    raise
                await self.failed(exc)
                continue
            self.recovered()
            return result
