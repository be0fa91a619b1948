"""The archive stream of one namespace: every group's fate, added by the scripts that decide it
(``common/scripts/_archive.lua``), read and confirmed by ``rollstream archive``. It has no consumer
group: the archiver's files hold its cursor, and a confirmed record is deleted."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from .. import lua
from ..keys import Keys, StateField
from .guard import Entry, Guarded, flat_entries


class ArchiveStream(Guarded):
    """Read fate records after a cursor, confirm the ones written to files."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._archived = lua.ARCHIVED.bind(redis, keys)

    async def after(self, cursor: str, count: int, blocking: Redis | None = None, block_ms: int = 0) -> list[Entry]:
        """Up to ``count`` records with ids above ``cursor`` (``0-0``: from the start), oldest first;
        with ``blocking`` (a client made for blocking reads), waiting up to ``block_ms`` for one."""
        if blocking is not None and block_ms > 0:
            reply = await blocking.xread({self.keys.archive: cursor}, count=count, block=block_ms)
            return flat_entries(reply[0][1] if reply else [])
        return flat_entries(await self.redis.xrange(self.keys.archive, min=f"({cursor}", count=count))

    async def up_to(self, cursor: str, count: int) -> list[Entry]:
        """Records at or below ``cursor``: written to files by an archiver killed before it confirmed them."""
        return flat_entries(await self.redis.xrange(self.keys.archive, max=cursor, count=count))

    async def confirm(self, pairs: Sequence[tuple[bytes, int]], cursor: str, now: int, token: str) -> bool:
        """Delete records written to files (id, record size) and leave them out of the ledger, if
        the archiver lease holds ``token``; False (nothing changed) when it does not."""
        flat: list[bytes | str | int] = []
        for record_id, size in pairs:
            flat.extend((record_id, size))
        reply = int(await self._archived(lease=self.keys.archiver_lease, token=token, cursor=cursor, now_ms=now,
                                         pairs=flat))
        return reply >= 0

    async def dropped(self) -> int:
        raw = await self.redis.hget(self.keys.state, StateField.ARCHIVE_DROPPED)
        try:
            return int(raw or 0)
        except ValueError:
            return 0

    async def length(self) -> int:
        return int(await self.redis.xlen(self.keys.archive))
