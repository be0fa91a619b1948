"""A producer's side of the prompt streams (``retry`` first, then ``prompts``)."""

from __future__ import annotations

from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from .. import lua
from ..config import PipelineConfig
from ..events import now_ms
from ..keys import PRODUCERS_GROUP, Keys, StateField
from ..mix import source_caps
from ..payload.refs import ObjectRef, group_member
from .guard import Guarded, flat_entries

# -- prompt queue (producers) ----------------------------------------------------------------


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


@dataclass(frozen=True, slots=True)
class Admitted:
    """A prompt entry handed to a producer, with the stream it came from (``prompts`` or
    ``retry``): every later operation on it (publish, renew, return, dead-letter) names it."""

    stream: str
    entry_id: bytes
    fields: dict[bytes, bytes]
    previous: Pending | None = None
    """A take-over's: the entry's pending row just before it was claimed (who held it, how long idle)."""


@dataclass(frozen=True, slots=True)
class Pending:
    """A pending entry's row (XPENDING's extended form): under which consumer, idle how long."""

    consumer: str
    idle_ms: int
    deliveries: int

    def describe(self) -> str:
        return f"pending under {self.consumer}, idle {self.idle_ms / 1000:.1f} s, delivered {self.deliveries} times"


@dataclass(frozen=True, slots=True)
class Admission:
    """The ADMIT script's answer: ``ok`` with prompt entries, else why nothing was read."""

    status: str
    """``ok``, ``empty``, ``paused``, ``backlog``, ``backlog_bytes`` or ``staleness``."""
    entries: list[Admitted] = field(default_factory=list)
    weight_version: int | None = None
    """The trainer's version, read with ``ok`` only: a refusal carries none (never a 0 that would
    tell the engine fleet the trainer restarted)."""
    terms: list[int] = field(default_factory=list)
    """A refusal's numbers: ``backlog``: [ready]; ``backlog_bytes``: [projected bytes, budget];
    ``staleness``: [outstanding, capacity, c, G]."""


class PromptQueue(Guarded):
    """One producer's operations on the prompt streams (``retry`` and ``prompts``, consumer
    group ``producers``); every operation on an admitted entry names its stream."""

    def __init__(self, redis: Redis, keys: Keys, consumer: str) -> None:
        self.redis = redis
        self.keys = keys
        self.consumer = consumer
        self._admit = lua.ADMIT.bind(redis, keys)
        self._renew = lua.RENEW.bind(redis, keys)
        self._reclaim_turn = lua.RECLAIM_TURN.bind(redis, keys)
        self._publish = lua.PUBLISH.bind(redis, keys)
        self._move = lua.MOVE.bind(redis, keys)
        self._reclaim_cursors = {keys.eval_prompts: "0-0", keys.retry: "0-0", keys.prompts: "0-0"}

    @property
    def streams(self) -> tuple[str, str, str]:
        """The prompt streams in admission order: the eval lane, then retry, then prompts."""
        return (self.keys.eval_prompts, self.keys.retry, self.keys.prompts)

    async def admit(self, config: PipelineConfig, count: int = 1) -> Admission:
        """Read up to ``count`` prompts (retry stream first) if the pipeline is not paused, the
        ready backlog has room and staleness-aware admission allows it under ``config`` (one
        atomic script)."""
        reply = await self._admit(
            consumer=self.consumer, max_backlog=config.max_backlog,
            admission=1 if config.admission_enabled else 0, max_staleness=config.max_staleness or 0,
            batch_size=config.batch_size, steps_per_version=config.steps_per_version, count=max(1, count),
            now_ms=now_ms(), max_backlog_bytes=config.max_backlog_bytes,
            source_caps=source_caps(config.mix, config.max_backlog, config.batch_size),
        )
        status = lua.status(reply[0])
        if status != "ok":
            return Admission(status, terms=[int(x) for x in reply[1:]])
        streams = (self.keys.retry, self.keys.prompts, self.keys.eval_prompts)
        entries = []
        for i in range(2, len(reply), 3):
            flat = reply[i + 2] or []
            fields = dict(zip(flat[::2], flat[1::2], strict=True))
            entries.append(Admitted(streams[int(reply[i]) - 1], reply[i + 1], fields))
        return Admission(status, entries, int(reply[1]))

    async def wait_for_new(self, blocking: Redis, block_ms: int) -> None:
        """Block (on a client made for blocking) until a prompt is added, or ``block_ms`` pass."""
        await blocking.xread({stream: "$" for stream in self.streams}, count=1, block=block_ms)

    async def renew(self, stream: str, ids: Sequence[bytes]) -> list[bytes]:
        """Renew the leases of ``ids`` (entries of ``stream``); the ids this producer no longer owns."""
        if not ids:
            return []
        return list(await self._renew(stream=stream, consumer=self.consumer, ids=list(ids)))

    async def own_pending_ids(self, stream: str, count: int = 1000) -> list[bytes]:
        """The ids pending under this producer's name in ``stream`` (at most ``count``)."""
        rows = await self.redis.xpending_range(
            stream, PRODUCERS_GROUP, min="-", max="+", count=count, consumername=self.consumer
        )
        return [row["message_id"] for row in rows]

    async def own_pending(self, count: int = 1000) -> list[Admitted]:
        """Claim back the prompts pending under this producer's name (a restart with the same name)."""
        out: list[Admitted] = []
        for stream in self.streams:
            pending = await self.redis.xpending_range(
                stream, PRODUCERS_GROUP, min="-", max="+", count=count, consumername=self.consumer
            )
            if not pending:
                continue
            ids = [p["message_id"] for p in pending]
            claimed = await self.redis.xclaim(stream, PRODUCERS_GROUP, self.consumer, 0, ids)
            out.extend(Admitted(stream, eid, fields) for eid, fields in flat_entries(claimed))
        return out

    async def reclaim_turn(self, interval_ms: int) -> tuple[bool, int]:
        """(whether this producer looks for idle prompts this interval, when idle prompts were
        last found): one look per interval for the fleet instead of one per producer, since it
        walks the whole pending list (docs/scale.md)."""
        async with self._guard():
            won, due = await self._reclaim_turn(now_ms=now_ms(), interval_ms=max(1, interval_ms))
            return bool(won), int(due)

    async def announce_reclaim(self) -> None:
        """Record that prompts sit idle past the lease: every producer takes over what it has
        room for at its next turn."""
        await self.redis.hset(self.keys.state, StateField.RECLAIM_DUE_MS, now_ms())

    async def any_idle(self, lease_ms: int) -> bool:
        """Whether some prompt sits idle past the lease (its producer is gone)."""
        for stream in self.streams:
            if await self.redis.xpending_range(stream, PRODUCERS_GROUP, min="-", max="+", count=1, idle=lease_ms):
                return True
        return False

    async def reclaim(self, lease_ms: int, count: int, held: Container[bytes] = ()) -> list[Admitted]:
        """Take over up to ``count`` prompts idle past the lease (XAUTOCLAIM from the cursor kept
        per stream, retry first). Entries deleted meanwhile come back with empty fields (see
        :meth:`ack_deleted`) or, on Redis 6.2, as nil without their ids: those are found among this
        consumer's own pending entries (except the ``held`` ones it works on) and acknowledged."""
        out: list[Admitted] = []
        for stream in self.streams:
            want = max(1, count) - len(out)
            if want <= 0:
                break
            # Who held them and how long they sat idle, for the log: the rows XAUTOCLAIM is about
            # to look at (it looks at ``10 * count`` at most), read only when prompts are due.
            rows = await self.redis.xpending_range(
                stream, PRODUCERS_GROUP, min=self._reclaim_cursors[stream], max="+", count=10 * want
            )
            previous = {
                row["message_id"]: Pending(
                    _text(row["consumer"]), int(row["time_since_delivered"]),
                    int(row["times_delivered"]),
                )
                for row in rows
            }
            reply = await self.redis.xautoclaim(
                stream, PRODUCERS_GROUP, self.consumer, lease_ms, start_id=self._reclaim_cursors[stream], count=want,
            )
            cursor, claimed = reply[0], reply[1]
            self._reclaim_cursors[stream] = cursor.decode() if isinstance(cursor, bytes) else str(cursor)
            if any(row[0] is None for row in claimed):
                await self._ack_claimed_deleted(stream, held)
            out.extend(Admitted(stream, eid, fields, previous.get(eid)) for eid, fields in flat_entries(claimed))
        return out

    async def _ack_claimed_deleted(self, stream: str, held: Container[bytes]) -> None:
        rows = await self.redis.xpending_range(
            stream, PRODUCERS_GROUP, min="-", max="+", count=1000, consumername=self.consumer
        )
        for row in rows:
            entry_id = row["message_id"]
            if entry_id not in held and not await self.redis.xrange(stream, entry_id, entry_id):
                await self.redis.xack(stream, PRODUCERS_GROUP, entry_id)

    @property
    def reclaim_scanned(self) -> bool:
        """Whether the last :meth:`reclaim` reached the end of both streams."""
        return all(cursor in ("0-0", "0") for cursor in self._reclaim_cursors.values())

    async def ack_deleted(self, stream: str, entry_id: bytes) -> None:
        """Acknowledge (and delete) an entry that came back without fields."""
        await self._ack_or_nogroup(stream, PRODUCERS_GROUP, entry_id)
        await self.redis.xdel(stream, entry_id)

    async def count_reclaimed(self) -> None:
        await self.redis.hincrby(self.keys.state, StateField.RECLAIMED, 1)

    async def publish(
        self, stream: str, entry_id: bytes, group_fields: Mapping[str, Any], journal: str | None = None,
        objects: Sequence[ObjectRef] = (), prompt_fields: Mapping[Any, Any] | None = None,
    ) -> bytes | None:
        """Publish a group and acknowledge its prompt atomically (deleting its episode
        ``journal``); None for a duplicate (the prompt was taken over and acknowledged by another
        producer). The size of its ``data`` enters the byte ledger; a prompt of the eval lane
        publishes to ``eval_groups``, outside the ledger and the sources' counters. ``objects``:
        the payload store objects it refers to (put already, one group's :func:`~..payload.refs.object_keys`):
        claimed as one ledger member, and their bytes in the ledger too; a duplicate queues them to be freed.
        ``prompt_fields``: the prompt entry as admitted; the objects its ``refs`` names (a partial
        rollout's retry prompt) are released with it."""
        lane = stream == self.keys.eval_prompts
        store_bytes = sum(ref.size for ref in objects)
        published = await self._publish(
            source=stream, group=PRODUCERS_GROUP, prompt_id=entry_id, now_ms=now_ms(),
            groups=self.keys.eval_groups if lane else self.keys.groups,
            objects=f"{group_member([ref.key for ref in objects])}:{store_bytes}" if objects else "",
            data_bytes=0 if lane else len(group_fields.get("data", b"")) + store_bytes,
            eval_bytes=len(group_fields.get("data", b"")) if lane else 0, fields=lua.flatten(group_fields),
            tally="" if lane else lua.tally(group_fields, "published"), **lua.journal(self.keys, journal),
            prompt_refs=lua.refs(prompt_fields or {}),
        )
        return published or None

    async def trained_steps(self) -> int:
        """The trainer's committed steps (``state.trained_steps``): an eval group's ``step``."""
        raw = await self.redis.hget(self.keys.state, StateField.TRAINED_STEPS)
        return int(raw) if raw is not None and raw.isdigit() else 0

    async def give_back(self, stream: str, entry_id: bytes, fields: Mapping[Any, Any]) -> bool:
        """Put an unfinished prompt into the retry stream, attempt unchanged (an eval prompt back
        into the eval lane); its episode journal stays, pointing at the new entry."""
        k = self.keys
        target = k.eval_prompts if stream == k.eval_prompts else k.retry
        return bool(await self._move(
            **lua.move_terms(k, stream, target), group=PRODUCERS_GROUP, entry_id=entry_id,
            counter=StateField.RETURNED, fields=lua.flatten(fields),
            **lua.journal(k, lua.episode_of(k, stream, fields), keep=True),
            tally="" if stream == k.eval_prompts else lua.tally(fields, "returned"),
        ))

    async def dead_letter(
        self, stream: str, entry_id: bytes, fields: Mapping[Any, Any], reason: str, journal: str | None = None,
        objects: Sequence[ObjectRef] = (),
    ) -> bool:
        """Move a prompt to the dead-letter stream with ``reason`` (archived as ``dead_lettered``;
        its episode ``journal`` deleted in the same step). ``objects``: payload objects ``fields``
        refer to, put already (a dead letter's partial samples, one object set): claimed in the
        same step, or queued to be freed when the prompt was no longer ours."""
        k, now = self.keys, now_ms()
        store_bytes = sum(ref.size for ref in objects)
        return bool(await self._move(
            **lua.move_terms(k, stream, k.dead), group=PRODUCERS_GROUP, entry_id=entry_id, counter=StateField.DEAD,
            fields=lua.flatten(lua.dead_letter(k, stream, entry_id, reason, fields, now)), fate="dead_lettered",
            reason=reason, actor=self.consumer, now_ms=now, tally=lua.tally(fields, "lost"), **lua.journal(k, journal),
            objects=f"{group_member([ref.key for ref in objects])}:{store_bytes}" if objects else "",
        ))
