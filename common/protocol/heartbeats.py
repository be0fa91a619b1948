"""The producers' heartbeats in Redis: written by a producer, read whole by the others."""

from __future__ import annotations

from redis.asyncio import Redis

from ..heartbeat import Fleet, Heartbeat, fold
from ..keys import Keys, StateField
from .guard import Translated


class Heartbeats(Translated):
    """The ``producers`` hash of a namespace: one heartbeat (JSON) per producer name."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def write(self, name: str, beat: Heartbeat, blocked_ms: int = 0) -> None:
        """Write ``beat`` and add ``blocked_ms`` of refused admission to the namespace's total."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hset(self.keys.producers, name, beat.to_json())
            if blocked_ms > 0:
                pipe.hincrby(self.keys.state, StateField.ADMISSION_BLOCKED_MS, blocked_ms)
            await pipe.execute()

    async def raw(self) -> dict[bytes, bytes]:
        """The raw hash: producer name -> heartbeat JSON (fold it with :func:`~..heartbeat.fold`)."""
        return dict(await self.redis.hgetall(self.keys.producers))

    async def fleet(self, now: int, timeout_s: float) -> Fleet:
        """Every producer's heartbeat, judged by the liveness rule at ``now``."""
        return fold(await self.raw(), now, timeout_s)

    async def get(self, name: str) -> Heartbeat | None:
        """One producer's heartbeat; None when it has none (ValueError when unreadable)."""
        raw = await self.redis.hget(self.keys.producers, name)
        return None if raw is None else Heartbeat.parse(raw)

