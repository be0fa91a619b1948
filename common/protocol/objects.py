"""The payload plane's ledgers in Redis (issue 48): the intents a producer writes before it puts
objects in the store, the objects entries hold (claimed by PUBLISH, released by the fate scripts
into the to-free set), and the sweep of intents nobody published. The store itself is never
called from here (nor from Lua): the caller deletes what :meth:`PayloadLedger.to_free` lists
and confirms with :meth:`PayloadLedger.freed` only the keys the store confirmed gone."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from redis.asyncio import Redis

from .. import lua
from ..keys import Keys, StateField
from ..redis_values import int_or, text
from .guard import Guarded


@dataclass(frozen=True, slots=True)
class PayloadHeld:
    """What ``inspect`` shows of the payload plane."""

    objects: int
    """Object sets (one per group, whatever its sample count) some entry refers to."""
    bytes: int
    intents: int
    """Object sets (groups) being put and not published yet."""
    to_free: int
    """Object sets (groups) released and not yet confirmed deleted by the store."""
    swept: int
    freed: int
    read_failures: int
    last_failure: str


class PayloadLedger(Guarded):
    """One namespace's payload ledgers."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._sweep = lua.SWEEP_PAYLOAD.bind(redis, keys)
        self._adopt = lua.ADOPT_ORPHANS.bind(redis, keys)

    async def intend(self, members: Sequence[str], deadline_ms: int) -> None:
        """Record object sets about to be put (before the put; one member per group,
        :func:`~..payload.refs.group_member`): unclaimed past ``deadline_ms``, swept."""
        if members:
            await self.redis.zadd(self.keys.payload_intents, dict.fromkeys(members, deadline_ms))

    async def abandon(self, members: Sequence[str], now: int) -> None:
        """Object sets put (or partly put) for a group that will not be published: freed at once."""
        if members:
            async with self.redis.pipeline(transaction=False) as pipe:  # to free first: never lost between
                pipe.zadd(self.keys.payload_free, dict.fromkeys(members, now))
                pipe.zrem(self.keys.payload_intents, *members)
                await pipe.execute()

    async def sweep(self, now: int, count: int = 1000) -> list[str]:
        """Intents past their deadline moved to the to-free set (counted as orphans swept)."""
        return [text(k) for k in await self._sweep(now_ms=now, count=count)]

    async def adopt_orphans(self, listed: Sequence[str], now: int) -> int:
        """Of keys listed in the store, queue to free the object sets no ledger knows (leaked);
        how many sets."""
        return int(await self._adopt(now_ms=now, keys=listed)) if listed else 0

    async def to_free(self, count: int = 500) -> list[str]:
        """Object sets released, oldest first, up to ``count``: delete their keys from the store,
        then :meth:`freed` the sets whose every key the store confirmed gone."""
        return [text(k) for k in await self.redis.zrange(self.keys.payload_free, 0, count - 1)]

    async def freed(self, members: Sequence[str], objects: int) -> int:
        """The store confirmed every key of these sets gone: out of the to-free set, and
        ``objects`` (their keys) counted freed; the number of sets removed."""
        if not members:
            return 0
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.zrem(self.keys.payload_free, *members)
            pipe.hincrby(self.keys.state, StateField.PAYLOAD_FREED, objects)
            removed, _ = await pipe.execute()
        return int(removed)

    async def read_failed(self, message: str) -> None:
        """Count a group recycled because an object could not be read, and keep the message."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hincrby(self.keys.state, StateField.PAYLOAD_READ_FAILURES, 1)
            pipe.hset(self.keys.state, StateField.PAYLOAD_LAST_FAILURE, message[:500])
            await pipe.execute()

    async def held(self) -> PayloadHeld:
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.hlen(self.keys.payload_held)
            pipe.zcard(self.keys.payload_intents)
            pipe.zcard(self.keys.payload_free)
            pipe.hmget(self.keys.state, StateField.PAYLOAD_BYTES, StateField.PAYLOAD_SWEPT, StateField.PAYLOAD_FREED,
                       StateField.PAYLOAD_READ_FAILURES, StateField.PAYLOAD_LAST_FAILURE)
            objects, intents, to_free, state = await pipe.execute()
        held_bytes, swept, freed, failures, last = state
        return PayloadHeld(
            objects=int(objects), bytes=int_or(held_bytes, 0), intents=int(intents), to_free=int(to_free),
            swept=int_or(swept, 0), freed=int_or(freed, 0), read_failures=int_or(failures, 0),
            last_failure=text(last) if last else "",
        )
