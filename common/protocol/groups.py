"""The trainer's side of the group stream, and its consumer-name lease (the names held now:
:meth:`.keyspace.Keyspace.trainer_names`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..events import now_ms
from ..keys import TRAINER_GROUP, Keys, SourceField, StateField
from .guard import Entry, Guarded, flat_entries

# -- trainer consumer name lease -------------------------------------------------------------


class NameLease(Guarded):
    """A trainer consumer name held by one live process: its token in a key with a TTL, renewed
    while it is connected and deleted on close (a crashed holder's lease just expires). ``key``
    leases another name the same way (the namespace's one archiver)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str, token: str, key: str | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.key = key if key is not None else keys.consumer_lease(consumer)
        self.token = token
        self._lease = lua.LEASE.bind(redis, keys)
        self._release = lua.RELEASE.bind(redis, keys)

    async def hold(self, ttl_ms: int) -> bool:
        """Take the name if free or renew it if ours; False while another process holds it."""
        return bool(await self._lease(lease=self.key, token=self.token, ttl_ms=ttl_ms))

    async def holder(self) -> str | None:
        raw = await self.redis.get(self.key)
        return None if raw is None else raw.decode("utf-8", "replace")

    async def release(self) -> bool:
        """Delete the lease if this process still holds it."""
        return bool(await self._release(lease=self.key, token=self.token))


# -- group queue (trainer) -------------------------------------------------------------------


class GroupQueue(Guarded):
    """One trainer consumer's operations on the group stream (consumer group ``trainer``)."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._forget = lua.FORGET.bind(redis, keys)
        self._move = lua.MOVE.bind(redis, keys)
        self._ack_delete = lua.ACK_DELETE.bind(redis, keys)
        self._row_stats = lua.ROW_STATS.bind(redis, keys)

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
        """Acknowledge a delivered entry that is gone from the stream (and forget its bytes;
        its payload objects are released)."""
        await self._forget(entry_id=entry_id, now_ms=now_ms())

    async def recycle(self, entry_id: bytes, counter: str, prompt_fields: Mapping[str, Any], reason: str = "") -> bool:
        """A group's prompt back to the retry stream (archived as ``recycled`` with ``reason``)."""
        k = self.keys
        return bool(await self._move(
            **lua.move_terms(k, k.groups, k.retry), group=TRAINER_GROUP, entry_id=entry_id, counter=counter,
            fields=lua.flatten(prompt_fields), fate="recycled", reason=reason or counter, actor=self.consumer,
            now_ms=now_ms(), tally=lua.tally(prompt_fields, "recycled"), **lua.journal(k, None),
        ))

    async def dead_letter(self, entry_id: bytes, fields: Mapping[Any, Any], reason: str) -> bool:
        """Move a group to the dead-letter stream with ``reason`` (archived as ``dead_lettered``)."""
        k, now = self.keys, now_ms()
        return bool(await self._move(
            **lua.move_terms(k, k.groups, k.dead), group=TRAINER_GROUP, entry_id=entry_id, counter=StateField.DEAD,
            fields=lua.flatten(lua.dead_letter(k, k.groups, entry_id, reason, fields, now)), fate="dead_lettered",
            reason=reason, actor=self.consumer, now_ms=now, tally=lua.tally(fields, "lost"), **lua.journal(k, None),
        ))

    async def drop_filtered(self, entry_id: bytes, reason: str, source: str = "") -> int:
        """Acknowledge and delete a group the trainer filtered out (archived as ``filtered``)."""
        return await self._ack(
            [entry_id], [SourceField.of(source, "lost") if source else ""], counter=StateField.FILTERED,
            second_counter=StateField.filtered(reason), fate="filtered", reason=reason,
        )

    async def record_rows(self, k: int, items: Sequence[tuple[str, float, float, int, int]]) -> int:
        """Finished groups into their rows' statistics (``Keys.rows``, the last ``k`` kept): (field,
        mean reward, reward variance, version, epoch) each."""
        if not items:
            return 0
        return int(await self._row_stats(k=k, items=[v for item in items for v in item]))

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
                if await self._move(
                    **lua.move_terms(self.keys, self.keys.groups, self.keys.groups), group=TRAINER_GROUP,
                    entry_id=entry_id, counter=StateField.RELEASED, fields=lua.flatten(fields),
                    **lua.journal(self.keys, None),
                ):
                    moved += 1
        await self.redis.xgroup_delconsumer(self.keys.groups, TRAINER_GROUP, self.consumer)
        return moved

    async def commit(self, ids: Sequence[bytes], sources: Sequence[str] = ()) -> int:
        """Acknowledge and delete ``ids`` (of groups from ``sources``, one per id, when named);
        the number acknowledged now."""
        return await self._ack(
            ids, [SourceField.of(s, "committed") if s else "" for s in sources], counter=StateField.COMMITTED,
            time_field=StateField.LAST_COMMIT_MS, fate="trained",
        )

    async def _ack(self, ids: Sequence[bytes], tally: Sequence[str], **named: str) -> int:
        """ACK_DELETE on the group stream (the byte ledger follows), each id's fate archived in the
        order given (a batch's order); ``tally``: one ``sources`` field per id, or none."""
        if not ids:
            return 0
        acked = await self._ack_delete(
            stream=self.keys.groups, sizes=self.keys.group_bytes, group=TRAINER_GROUP, ids=ids, actor=self.consumer,
            now_ms=now_ms(),
            tally=json.dumps(list(tally)) if any(tally) else "", **named,
        )
        return int(acked)
