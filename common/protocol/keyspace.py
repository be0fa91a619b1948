"""A namespace's keys as a whole: find them (SCAN, never KEYS) and delete them."""

from __future__ import annotations

from redis.asyncio import Redis

from ..keys import Keys
from ..redis_values import text
from .guard import Server, Translated


class Keyspace(Translated):
    """Every key of one namespace: the fixed ones and the per-consumer ones (journals, leases)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._server = Server(redis)

    async def _per_consumer_keys(self) -> list[bytes]:
        return [key for pattern in self.keys.per_consumer_patterns for key in await self._server.scan(pattern)]

    async def existing(self) -> list[str]:
        """This namespace's keys that exist (what :meth:`drop` would delete)."""
        fixed = [key for key in self.keys.all_keys() if await self.redis.exists(key)]
        return fixed + sorted(k.decode() for k in await self._per_consumer_keys())

    async def drop(self) -> int:
        """Delete exactly this namespace's keys (journals and name leases included); the number of
        keys that existed."""
        return int(await self.redis.delete(*self.keys.all_keys(), *await self._per_consumer_keys()))

    async def trainer_names(self) -> list[str]:
        """The trainer consumer names held by a live trainer now (their name leases)."""
        prefix = self.keys.consumer_lease("")
        return sorted(text(k)[len(prefix):] for k in await self._server.scan(self.keys.lease_pattern))
