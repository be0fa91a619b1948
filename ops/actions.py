"""Operator control of a namespace: pause and resume admission, release a gone trainer.

Pause/resume write the ``state`` hash and wake waiting producers on the control channel, the
same writes a trainer's ``GroupConsumer.pause()/resume()`` make, without registering a consumer.
"""

from __future__ import annotations

from redis.asyncio import Redis
from rollstream.common.errors import ConsumerNameInUse
from rollstream.common.keys import Keys
from rollstream.common.namespace import load_config
from rollstream.common.protocol import Control, GroupQueue, Keyspace, NameLease


async def pause(redis: Redis, keys: Keys) -> None:
    """Stop every producer from admitting new prompts (effective at once: ADMIT checks it).
    Raises ``NamespaceNotInitialized`` rather than pausing a namespace nobody configured."""
    await load_config(redis, keys)
    await Control(redis, keys).pause()


async def resume(redis: Redis, keys: Keys, version: int | None = None) -> None:
    """Let producers admit again, optionally recording a new weight version first."""
    await load_config(redis, keys)
    await Control(redis, keys).resume(version)


async def release_consumer(redis: Redis, keys: Keys, consumer: str) -> int:
    """Give a gone trainer consumer's pending groups back to the stream, then delete it; the
    number of groups moved back (see :meth:`~rollstream.common.protocol.GroupQueue.release`).
    Refused with ``ConsumerNameInUse`` while a live trainer holds that name: it would train the
    released groups a second time."""
    if consumer in await Keyspace(redis, keys).trainer_names():
        raise ConsumerNameInUse(
            keys.namespace, consumer, await NameLease(redis, keys, consumer, "").holder(),
            "release-trainer only hands back the groups of a trainer that is gone",
        )
    return await GroupQueue(redis, keys, consumer).release()
