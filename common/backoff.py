"""One exponential backoff with jitter, for every retry loop of rollstream.

``Backoff(base, cap).delay(attempt)`` is ``min(cap, base * 2**attempt)`` scaled by a random factor
in ``[1 - jitter, 1]`` (full delays would make many retrying producers move in lock step).
Attempts count from 0. Redis outages (:class:`~rollstream.common.connection.Outage`) and remote
rewards use it; the engine client can take it over.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True, slots=True)
class Backoff:
    """Delays of a retry loop: exponential from ``base`` seconds, at most ``cap``, with jitter."""

    base: float
    cap: float
    jitter: float = 0.5
    """The delay is scaled by a random factor in ``[1 - jitter, 1]``."""

    def __post_init__(self) -> None:
        if not self.base > 0 or not self.cap >= self.base:
            raise ConfigError(f"backoff needs 0 < base <= cap, got base {self.base!r}, cap {self.cap!r}")
        if not 0 <= self.jitter <= 1:
            raise ConfigError(f"backoff jitter must be within 0..1, got {self.jitter!r}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number ``attempt + 1``."""
        raw = min(self.cap, self.base * 2.0 ** min(max(attempt, 0), 32))
        return raw * (1 - self.jitter * random.random())

    async def sleep(self, attempt: int) -> None:
        await asyncio.sleep(self.delay(attempt))
