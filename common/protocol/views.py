"""Read-only looks at a namespace (``inspect``, snapshots): everything ``ops.snapshot`` reads goes
through :class:`StreamView`."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from ..admission import AdmissionTerms
from ..config import PipelineConfig
from ..events import Event, recent_events
from ..keys import Keys
from ..redis_errors import is_oom
from .guard import Guarded, Server, raise_if_refused
from .heartbeats import Heartbeats
from .trainer import TrainerMonitor

# -- read-only views (operators) ------------------------------------------------------------


class StreamView(Guarded):
    """Read-only looks at a namespace's streams and hashes (XINFO, XPENDING, XLEN, XRANGE, HGETALL);
    a stream or consumer group that does not exist yet reads as empty."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def length(self, stream: str) -> int:
        return int(await self.redis.xlen(stream))

    async def consumers(self, stream: str, group: str) -> list[dict[str, Any]]:
        """XINFO CONSUMERS rows (name, pending, idle, inactive on Redis >= 7.2)."""
        try:
            return list(await self.redis.xinfo_consumers(stream, group))
        except ResponseError as exc:  # no stream or no group yet
            raise_if_refused(exc)
            return []

    async def group_info(self, stream: str, group: str) -> dict[str, Any] | None:
        """The XINFO GROUPS row of ``group``, or None."""
        try:
            groups = await self.redis.xinfo_groups(stream)
        except ResponseError as exc:
            raise_if_refused(exc)
            return None
        for row in groups:
            name = row["name"]
            if (name.decode() if isinstance(name, bytes) else name) == group:
                return dict(row)
        return None

    async def pending_summary(self, stream: str, group: str) -> dict[str, Any] | None:
        """XPENDING's summary (``pending``, ``min``, ``max``, ``consumers``), or None without the group."""
        try:
            return dict(await self.redis.xpending(stream, group))
        except ResponseError as exc:
            raise_if_refused(exc)
            return None

    async def pending_idle_ms(self, stream: str, group: str, count: int) -> list[int]:
        """Milliseconds since delivery of up to ``count`` pending entries, oldest entries first."""
        rows = await self.redis.xpending_range(stream, group, min="-", max="+", count=count)
        return [int(r["time_since_delivered"]) for r in rows]

    async def first_after(self, stream: str, entry_id: str) -> bytes | None:
        """The id of the first entry after ``entry_id``, or None."""
        rows = await self.redis.xrange(stream, min=f"({entry_id}", max="+", count=1)
        return rows[0][0] if rows else None

    async def ledger(self) -> tuple[dict[bytes, bytes], int]:
        """The state hash and the entries in the work streams, read atomically (MULTI), so the
        counters and the stream lengths describe the same instant."""
        try:
            state, lengths = await self._ledger_reads(transaction=True)
        except ResponseError as exc:
            if not is_oom(exc):
                raise
            # At maxmemory Redis refuses every command queued in a MULTI, reads too: read the same
            # things without it (a hand-over between the reads can show as one entry off).
            state, lengths = await self._ledger_reads(transaction=False)
        return dict(state), sum(int(n) for n in lengths)

    async def _ledger_reads(self, *, transaction: bool) -> tuple[Any, list[Any]]:
        async with self.redis.pipeline(transaction=transaction) as pipe:
            pipe.hgetall(self.keys.state)
            for stream in self.keys.work_streams:
                pipe.xlen(stream)
            state, *lengths = await pipe.execute()
        return state, lengths

    async def config_hash(self) -> dict[bytes, bytes]:
        return dict(await self.redis.hgetall(self.keys.config))

    async def sources_hash(self) -> dict[bytes, bytes]:
        """The named sources' cursors and counters (``Keys.sources``)."""
        return dict(await self.redis.hgetall(self.keys.sources))

    async def state_hash(self) -> dict[bytes, bytes]:
        return dict(await self.redis.hgetall(self.keys.state))

    async def heartbeats(self) -> dict[bytes, bytes]:
        """The raw ``producers`` hash (damaged entries included: ``inspect`` reports them)."""
        return await Heartbeats(self.redis, self.keys).raw()

    async def admission_terms(self, config: PipelineConfig) -> AdmissionTerms:
        """The admission rule's terms now (what ADMIT would compute)."""
        return await TrainerMonitor(self.redis, self.keys).admission_terms(config)

    async def events(self, count: int) -> list[Event]:
        """The newest ``count`` events of the namespace's log (:func:`~..events.recent_events`)."""
        return await recent_events(self.redis, self.keys, count=count)

    async def memory(self) -> dict[str, Any] | None:
        """Redis' memory use and limit (:meth:`.guard.Server.memory`); None when INFO is refused."""
        return await Server(self.redis).memory()
