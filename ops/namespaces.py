"""Namespaces: list the ones present on a server, delete one (exactly its own keys).

Namespaces are found with SCAN, never KEYS, and deletion never uses FLUSHDB/FLUSHALL.
"""

from __future__ import annotations

from redis.asyncio import Redis
from rollstream.common import protocol
from rollstream.common.keys import NAMESPACE_SCAN_PATTERN, Keys, namespace_of

from ._fields import text


async def list_namespaces(redis: Redis) -> list[str]:
    """Namespaces with at least one key, found with SCAN (never KEYS: it blocks the server)."""
    found: set[str] = set()
    for key in await protocol.scan_namespace_keys(redis, NAMESPACE_SCAN_PATTERN):
        namespace = namespace_of(text(key))
        if namespace is not None:
            found.add(namespace)
    return sorted(found)


async def existing_keys(redis: Redis, keys: Keys) -> list[str]:
    """This namespace's keys that exist (what ``delete_namespace`` would delete)."""
    return await protocol.existing_keys(redis, keys)


async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys; the number of keys that existed."""
    return await protocol.delete_namespace(redis, keys)
