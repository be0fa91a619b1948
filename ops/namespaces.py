"""Namespaces: list the ones present on a server, delete one (exactly its own keys).

Namespaces are found with SCAN, never KEYS, and deletion never uses FLUSHDB/FLUSHALL.
"""

from __future__ import annotations

from redis.asyncio import Redis
from rollstream.common.config import PipelineConfig
from rollstream.common.keys import Keys
from rollstream.common.payload.plane import PayloadPlane
from rollstream.common.protocol import Keyspace, Server, StreamView


async def list_namespaces(redis: Redis) -> list[str]:
    """Namespaces with at least one key, found with SCAN (never KEYS: it blocks the server)."""
    return await Server(redis).namespaces()


async def existing_keys(redis: Redis, keys: Keys) -> list[str]:
    """This namespace's keys that exist (what ``delete_namespace`` would delete)."""
    return await Keyspace(redis, keys).existing()


async def delete_namespace(redis: Redis, keys: Keys) -> int:
    """Delete exactly this namespace's keys; the number of keys that existed."""
    return await Keyspace(redis, keys).drop()


async def delete_payload_objects(redis: Redis, keys: Keys) -> int:
    """Delete the namespace's objects from its payload store (before its keys: the config names
    the store); the number the store confirmed gone, 0 without a store."""
    raw = await StreamView(redis, keys).config_hash()
    if not raw:
        return 0
    config = PipelineConfig.from_redis(raw)
    if not config.payload_store:
        return 0
    plane = PayloadPlane.open(config.payload_store, redis, keys)
    try:
        return await plane.delete_all()
    finally:
        await plane.close()
