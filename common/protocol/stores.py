"""Hashes and streams operators and integrations own: dead letters, journals, stored flags."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..events import now_ms
from ..keys import Keys, StateField
from .guard import Entry, Guarded, flat_entries

# -- dead letters, namespaces ----------------------------------------------------------------


class DeadLetters(Guarded):
    """The dead-letter stream of a namespace (no consumer group: operators read and remove)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._requeue = lua.REQUEUE.bind(redis, keys)
        self._drop = lua.DROP_DEAD.bind(redis, keys)

    async def entries(self, *, ids: Sequence[str] | None = None, count: int | None = None) -> list[Entry]:
        """The given entries (missing ones skipped), else the first ``count``, oldest first."""
        if ids:
            rows: list[Any] = []
            for entry_id in ids:
                rows.extend(await self.redis.xrange(self.keys.dead, min=entry_id, max=entry_id))
        else:
            rows = await self.redis.xrange(self.keys.dead, count=count)
        return flat_entries(rows)

    async def requeue(self, entry_id: str, prompt_fields: Mapping[str, Any]) -> bytes | None:
        """Delete a dead entry and add its prompt to the retry stream, atomically; None when the
        entry was already gone."""
        requeued = await self._requeue(
            dead_id=entry_id, counter=StateField.REQUEUED, tally=lua.tally(prompt_fields, "requeued"),
            fields=lua.flatten(prompt_fields),
        )
        return requeued or None

    async def drop(self, ids: Sequence[str]) -> int:
        """Delete dead entries (their payload objects released); the number that existed."""
        return int(await self._drop(now_ms=now_ms(), ids=ids)) if ids else 0


class JournalHash(Guarded):
    """The raw hash behind the integrations' checkpoint journal (one per trainer consumer);
    what its fields hold is the journal's business (``rollstream.integrations.journal``)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.key = keys.journal(consumer)

    async def field_names(self) -> list[str]:
        return [raw.decode() if isinstance(raw, bytes) else str(raw) for raw in await self.redis.hkeys(self.key)]

    async def get(self, *fields: str) -> list[bytes | None]:
        return list(await self.redis.hmget(self.key, list(fields))) if fields else []

    async def put(self, mapping: Mapping[str, bytes | str]) -> None:
        await self.redis.hset(self.key, mapping=dict(mapping))

    async def delete(self, *fields: str) -> int:
        return int(await self.redis.hdel(self.key, *fields)) if fields else 0


class RolloutFlagsHash:
    """The stored copy of a run's rollout flags (``Keys.rollout_flags``): plain string fields, so
    ``HGETALL`` reads like the command line; what they mean is ``rollstream produce``'s business."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.key = keys.rollout_flags

    async def read(self) -> dict[str, str]:
        raw = await self.redis.hgetall(self.key)
        return {
            (k.decode() if isinstance(k, bytes) else str(k)): (v.decode() if isinstance(v, bytes) else str(v))
            for k, v in raw.items()
        }

    async def replace(self, fields: Mapping[str, str]) -> None:
        """The run's flags, whole: fields it no longer sets disappear (one MULTI/EXEC)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.key)
            if fields:
                pipe.hset(self.key, mapping=dict(fields))
            await pipe.execute()
