"""Namespaces: list the ones present on a server, delete one (exactly its own keys).

Namespaces are found with SCAN, never KEYS, and deletion never uses FLUSHDB/FLUSHALL.
"""

from __future__ import annotations

from redis.asyncio import Redis
from rollstream.common.keys import Keys
from rollstream.common.protocol import Keyspace, Server


async def list_namespaces(redis: Redis) -> list[str]:
    """Namespaces with at least one key, found with SCAN (never KEYS: it blocks the server)."""
    return await Server(redis).namespaces()


async def existing_keys(redis: Redis, keys: Keys) -> list[str]:
    """This namespace's keys that exist (what ``delete_namespace`` would delete)."""
    return await Keyspace(redis, keys).existing()


async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys; the number of keys that existed."""
    return await Keyspace(redis, keys).drop()
