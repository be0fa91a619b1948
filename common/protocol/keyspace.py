"""A namespace's keys as a whole: find them (SCAN, never KEYS) and delete them."""

from __future__ import annotations

from redis.asyncio import Redis

from ..keys import Keys
from ..redis_errors import translate_errors


@translate_errors
async def scan_namespace_keys(redis: Redis, match: str) -> list[bytes]:
    """Keys matching ``match``, found with SCAN (never KEYS: it blocks the server)."""
    return [key async for key in redis.scan_iter(match=match, count=1000)]


@translate_errors
async def _per_consumer_keys(redis: Redis, keys: Keys) -> list[bytes]:
    return [key for pattern in keys.per_consumer_patterns for key in await scan_namespace_keys(redis, pattern)]


@translate_errors
async def existing_keys(redis: Redis, keys: Keys) -> list[str]:
    fixed = [key for key in keys.all_keys() if await redis.exists(key)]
    return fixed + sorted(k.decode() for k in await _per_consumer_keys(redis, keys))


@translate_errors
async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys (journals and name leases included); the number of
    keys that existed."""
    return int(await redis.delete(*keys.all_keys(), *await _per_consumer_keys(redis, keys)))
