"""Operator control of a namespace: pause and resume admission, release a gone trainer.

Pause/resume write the ``state`` hash and wake waiting producers on the control channel, the
same writes a trainer's ``GroupConsumer.pause()/resume()`` make, without registering a consumer.
"""

from __future__ import annotations

from redis.asyncio import Redis
from rollstream.common.errors import ConfigError
from rollstream.common.keys import TRAINER_GROUP, Keys, StateField
from rollstream.common.lua import Scripts
from rollstream.common.namespace import load_config


async def pause(redis: Redis, keys: Keys) -> None:
    """Stop every producer from admitting new prompts (effective at once: ADMIT checks it).
    Raises ``NamespaceNotInitialized`` rather than pausing a namespace nobody configured."""
    await load_config(redis, keys)
    async with redis.pipeline(transaction=True) as pipe:
        pipe.hset(keys.state, StateField.PAUSED, 1)
        pipe.publish(keys.control, "pause")
        await pipe.execute()


async def resume(redis: Redis, keys: Keys, version: int | None = None) -> None:
    """Let producers admit again, optionally recording a new weight version first."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise ConfigError(f"weight version must be a non-negative integer, got {version!r}")
    await load_config(redis, keys)
    async with redis.pipeline(transaction=True) as pipe:
        if version is not None:
            pipe.hset(keys.state, StateField.WEIGHT_VERSION, version)
        pipe.hset(keys.state, StateField.PAUSED, 0)
        pipe.publish(keys.control, "resume" if version is None else f"resume {version}")
        await pipe.execute()


async def release_consumer(redis: Redis, keys: Keys, consumer: str) -> int:
    """Give a gone trainer consumer's pending groups back to the stream, then delete it.

    Each pending group is re-added as a new entry and its old entry acknowledged and deleted,
    atomically; only then is the consumer deleted (XGROUP DELCONSUMER with entries pending
    would discard them). Returns the number of groups moved back.
    """
    scripts = Scripts(redis, keys)
    moved = 0
    while True:
        pending = await redis.xpending_range(
            keys.groups, TRAINER_GROUP, min="-", max="+", count=500, consumername=consumer
        )
        if not pending:
            break
        for item in pending:
            entry_id = item["message_id"]
            rows = await redis.xrange(keys.groups, entry_id, entry_id)
            if not rows:
                await redis.xack(keys.groups, TRAINER_GROUP, entry_id)
                continue
            fields = {k.decode(): v for k, v in rows[0][1].items()}
            if await scripts.move(
                source=keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
                target=keys.groups, counter=StateField.RELEASED, fields=fields,
            ):
                moved += 1
    await redis.xgroup_delconsumer(keys.groups, TRAINER_GROUP, consumer)
    return moved
