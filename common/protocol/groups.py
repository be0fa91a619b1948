"""The trainer's side of the group stream, and its consumer-name lease (the names held now:
:meth:`.keyspace.Keyspace.trainer_names`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from ..events import now_ms
from ..keys import TRAINER_GROUP, Keys, SourceField, StateField
from ..lua import Scripts
from .guard import Entry, Guarded, flat_entries

# -- trainer consumer name lease -------------------------------------------------------------


class NameLease(Guarded):
    """A trainer consumer name held by one live process: its token in a key with a TTL, renewed
    while it is connected and deleted on close (a crashed holder's lease just expires). ``key``
    leases another name the same way (the namespace's one archiver)."""

    def __init__(
        self, redis: Redis, keys: Keys, consumer: str, token: str, scripts: Scripts | None = None,
        key: str | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.key = key if key is not None else keys.consumer_lease(consumer)
        self.token = token
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def hold(self, ttl_ms: int) -> bool:
        """Take the name if free or renew it if ours; False while another process holds it."""
        return await self.scripts.lease(self.key, self.token, ttl_ms)

    async def holder(self) -> str | None:
        raw = await self.redis.get(self.key)
        return None if raw is None else raw.decode("utf-8", "replace")

    async def release(self) -> bool:
        return await self.scripts.release(self.key, self.token)


# -- group queue (trainer) -------------------------------------------------------------------


class GroupQueue(Guarded):
    """One trainer consumer's operations on the group stream (consumer group ``trainer``)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, scripts: Scripts | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self.scripts = scripts if scripts is not None else Scripts(redis, keys)

    async def read(self, blocking: Redis, count: int, block_ms: int) -> list[Entry]:
        """New groups, up to ``count``, waiting up to ``block_ms`` (on a client made for blocking)."""
        reply = await blocking.xreadgroup(
            TRAINER_GROUP, self.consumer, {self.keys.groups: ">"}, count=count, block=block_ms
        )
        return flat_entries(reply[0][1] if reply else [])

    async def own_pending_page(self, after: str, count: int = 1000) -> list[Entry]:
        """Groups delivered to this consumer and not committed, after entry id ``after``."""
        reply = await self.redis.xreadgroup(TRAINER_GROUP, self.consumer, {self.keys.groups: after}, count=count)
        return flat_entries(reply[0][1] if reply else [])

    async def pending_ids(self, count: int = 10_000) -> list[bytes]:
        """Ids pending under this consumer (including those of reads whose reply was lost)."""
        pending = await self.redis.xpending_range(
            self.keys.groups, TRAINER_GROUP, min="-", max="+", count=count, consumername=self.consumer
        )
        return [p["message_id"] for p in pending]

    async def fetch(self, entry_id: bytes) -> dict[bytes, bytes]:
        """The fields of one entry; empty when it was deleted meanwhile."""
        rows = await self.redis.xrange(self.keys.groups, entry_id, entry_id)
        return dict(rows[0][1]) if rows else {}

    async def ack_deleted(self, entry_id: bytes) -> None:
        """Acknowledge a delivered entry that is gone from the stream (and forget its bytes)."""
        await self.scripts.forget_group(entry_id)

    async def recycle(self, entry_id: bytes, counter: str, prompt_fields: Mapping[str, Any], reason: str = "") -> bool:
        return await self.scripts.recycle(
            entry_id, counter, prompt_fields, reason=reason, actor=self.consumer, now_ms=now_ms()
        )

    async def dead_letter(self, entry_id: bytes, fields: Mapping[Any, Any], reason: str) -> bool:
        return await self.scripts.dead_letter(
            source=self.keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
            reason=reason, fields=fields, now_ms=now_ms(), actor=self.consumer,
        )

    async def drop_filtered(self, entry_id: bytes, reason: str, source: str = "") -> int:
        return await self.scripts.ack_delete(
            stream=self.keys.groups, group=TRAINER_GROUP, ids=[entry_id],
            counter=StateField.FILTERED, second_counter=StateField.filtered(reason),
            fate="filtered", reason=reason, actor=self.consumer, now_ms=now_ms(),
            tally=[SourceField.of(source, "lost") if source else ""],
        )

    async def record_rows(self, k: int, items: Sequence[tuple[str, float, float, int, int]]) -> int:
        """Finished groups into their rows' statistics (``Keys.rows``, the last ``k`` kept)."""
        return await self.scripts.row_stats(k, items)

    async def release(self) -> int:
        """Give this (gone) consumer's pending groups back to the stream as new entries, then
        delete the consumer; the number moved back. Each move is atomic (ack + delete + re-add),
        and the consumer is deleted only when nothing is pending (XGROUP DELCONSUMER would
        discard pending entries)."""
        moved = 0
        while True:
            pending = await self.pending_ids(count=500)
            if not pending:
                break
            for entry_id in pending:
                fields = await self.fetch(entry_id)
                if not fields:
                    await self.ack_deleted(entry_id)
                    continue
                if await self.scripts.move(
                    source=self.keys.groups, group=TRAINER_GROUP, entry_id=entry_id,
                    target=self.keys.groups, counter=StateField.RELEASED,
                    fields=fields,
                ):
                    moved += 1
        await self.redis.xgroup_delconsumer(self.keys.groups, TRAINER_GROUP, self.consumer)
        return moved

    async def commit(self, ids: Sequence[bytes], sources: Sequence[str] = ()) -> int:
        """Acknowledge and delete ``ids`` (of groups from ``sources``, one per id, when named);
        the number acknowledged now."""
        return await self.scripts.ack_delete(
            stream=self.keys.groups, group=TRAINER_GROUP, ids=ids,
            counter=StateField.COMMITTED, time_field=StateField.LAST_COMMIT_MS, now_ms=now_ms(),
            fate="trained", actor=self.consumer,
            tally=[SourceField.of(s, "committed") if s else "" for s in sources],
        )
