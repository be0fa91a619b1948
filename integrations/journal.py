"""The checkpoint journal: which groups each rollout trained, kept in Redis until a checkpoint holds it.

One hash per trainer consumer, ``rollstream:{ns}:journal:<consumer>`` (same hash tag as the
namespace's other keys), with fields

* ``batch:<rollout_id>``: msgpack ``{"groups": [encoded group, ...], "metrics": {...}}``;
* ``ids:<rollout_id>``: msgpack list of the groups' stream entry ids;
* ``meta``: JSON ``{"checkpoints": [saved rollout ids, newest last], "trimmed_through": id}``.

Its Redis commands are :class:`rollstream.common.protocol.JournalHash`'s. The journal is written before the
groups are committed (acknowledged and deleted from the groups stream), so a group is always in
the stream or in the journal; see docs/integrations.md for the whole design.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any

import msgpack
from redis.asyncio import Redis
from rollstream.common.codec import decode_group, encode_group
from rollstream.common.connection import Outage
from rollstream.common.keys import Keys
from rollstream.common.models import Group
from rollstream.common.protocol import JournalHash

logger = logging.getLogger(__name__)

_BATCH = "batch:"
_IDS = "ids:"
_META = "meta"


@dataclass(slots=True)
class JournalRecord:
    rollout_id: int
    groups: list[Group]
    entry_ids: list[bytes]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class JournalMeta:
    checkpoints: list[int] = field(default_factory=list)
    trimmed_through: int | None = None


def journal_key(namespace: str, consumer: str) -> str:
    return Keys(namespace).journal(consumer)


class Journal:
    """Every call rides out a Redis outage (a restarting embedded Redis, a failover) like the
    consumer's own calls do: each is idempotent (reads, HSET of the same values, HDEL)."""

    def __init__(self, redis: Redis, namespace: str, consumer: str) -> None:
        self.redis = redis
        self.hash = JournalHash(redis, Keys(namespace), consumer)
        self.key = self.hash.key
        self._outage = Outage(logger, f"journal {self.key}")

    async def rollout_ids(self) -> list[int]:
        out = []
        for name in await self._outage.run(self.hash.field_names):
            if name.startswith(_BATCH):
                out.append(int(name[len(_BATCH) :]))
        return sorted(out)

    async def entry_ids(self) -> set[bytes]:
        """The stream entry ids of every journaled group."""
        ids = await self.rollout_ids()
        if not ids:
            return set()
        rows = await self._outage.run(lambda: self.hash.get(*[f"{_IDS}{r}" for r in ids]))
        out: set[bytes] = set()
        for raw in rows:
            if raw:
                out.update(msgpack.unpackb(raw))
        return out

    async def get(self, rollout_id: int) -> JournalRecord | None:
        names = (f"{_BATCH}{rollout_id}", f"{_IDS}{rollout_id}")
        raw_batch, raw_ids = await self._outage.run(lambda: self.hash.get(*names))
        if raw_batch is None:
            return None
        batch: dict[str, Any] = msgpack.unpackb(raw_batch, raw=False)
        return JournalRecord(
            rollout_id=rollout_id,
            groups=[decode_group(g) for g in batch["groups"]],
            entry_ids=list(msgpack.unpackb(raw_ids)) if raw_ids else [],
            metrics={str(k): float(v) for k, v in batch.get("metrics", {}).items()},
        )

    async def put(self, record: JournalRecord) -> None:
        batch = msgpack.packb(
            {"groups": [encode_group(g) for g in record.groups], "metrics": record.metrics}, use_bin_type=True
        )
        ids = msgpack.packb(record.entry_ids, use_bin_type=True)
        fields = {f"{_BATCH}{record.rollout_id}": batch, f"{_IDS}{record.rollout_id}": ids}
        await self._outage.run(lambda: self.hash.put(fields))

    async def meta(self) -> JournalMeta:
        (raw,) = await self._outage.run(lambda: self.hash.get(_META))
        if not raw:
            return JournalMeta()
        obj = json.loads(raw)
        return JournalMeta(
            checkpoints=[int(c) for c in obj.get("checkpoints", [])],
            trimmed_through=obj.get("trimmed_through"),
        )

    async def set_meta(self, meta: JournalMeta) -> None:
        value = json.dumps({"checkpoints": meta.checkpoints, "trimmed_through": meta.trimmed_through})
        await self._outage.run(lambda: self.hash.put({_META: value}))

    async def trim_through(self, rollout_id: int) -> int:
        """Delete the records of rollouts up to ``rollout_id``; how many were deleted."""
        doomed = [r for r in await self.rollout_ids() if r <= rollout_id]
        if doomed:
            names = [f"{prefix}{r}" for r in doomed for prefix in (_BATCH, _IDS)]
            await self._outage.run(lambda: self.hash.delete(*names))
        return len(doomed)
