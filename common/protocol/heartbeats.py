"""The producers' heartbeats in Redis: written by a producer, read whole by the others."""

from __future__ import annotations

from redis.asyncio import Redis

from ..heartbeat import Heartbeat
from ..keys import Keys, StateField
from ..redis_errors import translate_errors


@translate_errors
async def write_heartbeat(redis: Redis, keys: Keys, name: str, beat: Heartbeat, blocked_ms: int) -> None:
    """Write ``beat`` and add ``blocked_ms`` of refused admission to the namespace's total."""
    async with redis.pipeline(transaction=False) as pipe:
        pipe.hset(keys.producers, name, beat.to_json())
        if blocked_ms > 0:
            pipe.hincrby(keys.state, StateField.ADMISSION_BLOCKED_MS, blocked_ms)
        await pipe.execute()


@translate_errors
async def read_heartbeats(redis: Redis, keys: Keys) -> dict[bytes, bytes]:
    """The raw ``producers`` hash: producer name -> heartbeat JSON (parse with :meth:`Heartbeat.parse`)."""
    return dict(await redis.hgetall(keys.producers))
