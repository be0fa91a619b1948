"""The feeder's cursor and the prompt stream it fills."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..errors import ConfigError
from ..keys import Keys, StateField
from ..redis_values import int_or, text
from .guard import Guarded

# -- feed ------------------------------------------------------------------------------------


def state_mismatch(keys: Keys, config_id: bytes | str | None, state_id: bytes | str | None) -> str | None:
    """Why the state hash is not this namespace's (its id differs from the config's), or None.
    A namespace made before ids existed (no id in its config) is never flagged."""
    if not config_id or text(config_id) == text(state_id):
        return None
    return (
        f"the state hash {keys.state} does not belong to namespace {keys.namespace!r} any more (its "
        f"{StateField.NAMESPACE_ID} is {text(state_id)[:40]!r}, the config's {text(config_id)[:40]!r}): it was "
        "deleted (DEL) or replaced, or Redis lost its data; its counters and the feeder cursor are gone"
    )


@dataclass(frozen=True, slots=True)
class FeedCursor:
    """Where the feeder stands: the next prompt index, epoch, position and the dataset id."""

    next_index: int
    epoch: int
    position: int
    dataset: str | None


class Feed(Guarded):
    """The feeder's operations: its cursor in ``state`` and the prompt stream it fills."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._feed = lua.FEED.bind(redis, keys)
        self._release = lua.RELEASE.bind(redis, keys)

    async def beat(self, token: str, ttl_ms: int) -> None:
        """Say a feeder (``token``: its host and pid) is alive for ``ttl_ms`` (``Keys.feeder``)."""
        await self.redis.set(self.keys.feeder, token, px=ttl_ms)

    async def release(self, token: str) -> None:
        """Forget the feeder's beat if it is still this feeder's."""
        await self._release(lease=self.keys.feeder, token=token)

    async def live_feeder(self) -> str | None:
        """The token of a feeder alive now (its beat not expired), or None."""
        raw = await self.redis.get(self.keys.feeder)
        return None if raw is None else text(raw)

    async def mix(self) -> str:
        """The namespace config's mix now ("" without one)."""
        return text(await self.redis.hget(self.keys.config, "mix") or b"")

    async def cursor(self) -> FeedCursor:
        """Where the feeder stands; ConfigError when the state hash is not this namespace's any
        more (deleted, Redis lost data) or the cursor is damaged: never feed again from 0."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.keys.config, StateField.NAMESPACE_ID)
            pipe.hget(self.keys.state, StateField.NAMESPACE_ID)
            config_id, state_id = await pipe.execute()
        if (why := state_mismatch(self.keys, config_id, state_id)) is not None:
            raise ConfigError(
                f"{why}. The feeder cursor went with it: feeding now would feed the dataset again from its "
                f"start (every prompt trained twice). Restore the state hash, or start over with "
                f"`rollstream ns delete --ns {self.keys.namespace}` then `init` and `feed`"
            )
        raw = await self.redis.hmget(
            self.keys.state,
            [StateField.FEED_NEXT_INDEX, StateField.FEED_EPOCH, StateField.FEED_POSITION, StateField.FEED_DATASET],
        )
        names = (StateField.FEED_NEXT_INDEX, StateField.FEED_EPOCH, StateField.FEED_POSITION)
        values = []
        for name, value in zip(names, raw[:3], strict=True):
            number = 0 if value is None else int_or(value, -1)
            if number < 0:  # never guess a cursor: feeding again from 0 would double the dataset
                raise ConfigError(
                    f"the feeder cursor is damaged: {self.keys.state} field {name!r} = {text(value)[:60]!r} is "
                    "not a non-negative integer; fix it (HSET) or re-create the namespace"
                )
            values.append(number)
        return FeedCursor(values[0], values[1], values[2], text(raw[3]) if raw[3] else None)

    async def queued(self) -> int:
        """Entries in the prompt stream (waiting or in flight)."""
        return int(await self.redis.xlen(self.keys.prompts))

    async def add(
        self, *, expected_next: int, next_after: int, epoch: int, position: int, dataset: str,
        entries: Sequence[Mapping[str, Any]], dead: Sequence[Mapping[str, Any]] = (),
        sources: Sequence[tuple[str, str, Any]] = (),
    ) -> int | None:
        """Add prompt entries, and dead letters for rows that cannot be fed, and move the cursor
        atomically, only from ``expected_next``; None when the cursor moved meanwhile (a re-sent
        call that went through, another feeder). ``sources``: (op, field, value) updates of the
        named sources' hash in the same step (``s``: set, ``i``: add)."""
        width = 2 * len(entries[0]) if entries else 0
        flat: list[Any] = []
        for fields in entries:
            if 2 * len(fields) != width:
                raise ValueError("every fed entry must have the same fields")
            flat.extend(lua.flatten(fields))
        added = await self._feed(
            expected_next=expected_next, next_after=next_after, epoch=epoch, position=position, dataset=dataset,
            rejected=json.dumps([[str(v) for v in lua.flatten(d)] for d in dead]),
            updates=json.dumps([str(v) for update in sources for v in update]), width=width or 2, entries=flat,
        )
        return None if added is None else int(added)


class Sources(Guarded):
    """The named sources' hash (``Keys.sources``: cursors, counters, the mix's carry baseline) and
    the per-row statistics a curriculum reads (``Keys.rows``)."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def state(self) -> dict[str, str]:
        raw = await self.redis.hgetall(self.keys.sources)
        return {text(k): text(v) for k, v in raw.items()}

    async def set(self, mapping: Mapping[str, str | int]) -> None:
        await self.redis.hset(self.keys.sources, mapping=dict(mapping))

    async def rows(self, fields: Sequence[str]) -> list[bytes | None]:
        """The statistics of the rows ``fields`` (``<source>:<row>``), None where a row has none."""
        if not fields:
            return []
        return list(await self.redis.hmget(self.keys.rows, list(fields)))

    async def scan_rows(self, count: int = 1000) -> AsyncIterator[list[tuple[str, str]]]:
        """Every row's statistics, in HSCAN chunks of about ``count`` (never the whole hash at once)."""
        cursor = 0
        while True:
            cursor, chunk = await self.redis.hscan(self.keys.rows, cursor, count=count)
            if chunk:
                yield [(text(k), text(v)) for k, v in chunk.items()]
            if int(cursor) == 0:
                return

    async def restore_rows(self, chunks: AsyncIterator[list[tuple[str, str]]] | Iterable[list[tuple[str, str]]]) -> int:
        """Replace the rows' statistics by ``chunks`` (written aside, then RENAMEd over, so readers
        see the old hash or the whole new one); returns how many rows were written."""
        staging = self.keys.rows_restoring
        await self.redis.delete(staging)
        written = 0

        async def put(chunk: list[tuple[str, str]]) -> None:
            nonlocal written
            if chunk:
                await self.redis.hset(staging, mapping=dict(chunk))
                written += len(chunk)

        if isinstance(chunks, AsyncIterator):
            async for chunk in chunks:
                await put(chunk)
        else:
            for chunk in chunks:
                await put(chunk)
        if written:
            await self.redis.rename(staging, self.keys.rows)
        else:
            await self.redis.delete(self.keys.rows)
        return written
