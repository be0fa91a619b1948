"""The Lua scripts that make every hand-over atomic.

MULTI/EXEC cannot branch on a result, and every hand-over must: a prompt attempt ends in exactly
one of *group published*, *prompt recycled* or *dead-lettered*, and only the holder whose XACK
returned 1 may do that. Each script therefore starts with the XACK (or a cursor check) and
does nothing else when it finds the work already done, which also makes every script safe to
re-send after a dropped connection.

All keys of a script share the namespace hash tag, so the scripts run on Redis Cluster. The
fields of the ``state`` hash are written ``$NAME`` and filled in from :class:`~.keys.StateField`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from string import Template
from typing import Any

from redis.asyncio import Redis

from .keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, StateField

_STATE_FIELDS = {name: value for name, value in vars(StateField).items() if name.isupper() and isinstance(value, str)}


def _template(source: str) -> str:
    """A script with its ``$NAME`` placeholders replaced by the ``StateField`` names, once at import
    (an unknown name fails the import)."""
    return Template(source).substitute(_STATE_FIELDS)


# KEYS: prompts, groups, state. ARGV: consumer group, prompt id, now ms, group fields...
PUBLISH = _template("""
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  redis.call('HINCRBY', KEYS[3], '$DUPLICATES', 1)
  return false
end
redis.call('XDEL', KEYS[1], ARGV[2])
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('HINCRBY', KEYS[3], '$PUBLISHED', 1)
redis.call('HSET', KEYS[3], '$LAST_PUBLISH_MS', ARGV[3])
return id
""")

# KEYS: source stream, target stream, state.
# ARGV: consumer group, entry id, counter field, fields of the new entry...
# Acknowledges and deletes an entry of the source stream and adds a new entry to the target
# stream: a prompt recycled (groups -> prompts), returned (prompts -> prompts) or
# dead-lettered (any -> dead).
MOVE = _template("""
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  return false
end
redis.call('XDEL', KEYS[1], ARGV[2])
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return id
""")

# KEYS: stream, state. ARGV: consumer group, counter, second counter or '', time field or '',
# now ms, entry ids... Acknowledges and deletes entries (commit, filtered drop); counts the
# acknowledged ones only.
ACK_DELETE = _template("""
local acked = redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 6))
if acked > 0 then
  redis.call('XDEL', KEYS[1], unpack(ARGV, 6))
  redis.call('HINCRBY', KEYS[2], ARGV[2], acked)
  if ARGV[3] ~= '' then redis.call('HINCRBY', KEYS[2], ARGV[3], acked) end
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[4], ARGV[5]) end
return acked
""")

# KEYS: prompts, groups, state. ARGV: group, consumer, max backlog, admission on (1/0),
# max staleness, batch size. Returns {reason} (paused | backlog | staleness | empty) or
# {'ok', id, fields, weight version}. Reads at most one prompt, and counts it as admitted, only when the
# pipeline is not paused, the group backlog is under its cap and (with admission control)
# admitted - recycled - filtered - dead - returned < (version + max_staleness + 1) * batch.
ADMIT = _template("""
local st = redis.call('HMGET', KEYS[3], '$PAUSED', '$WEIGHT_VERSION', '$ADMITTED',
  '$RECYCLED_ABORTED', '$RECYCLED_STALE', '$RECYCLED_FAILED', '$RECYCLED_FILTERED', '$FILTERED',
  '$DEAD', '$RETURNED')
if st[1] == '1' then return {'paused'} end
if redis.call('XLEN', KEYS[2]) >= tonumber(ARGV[3]) then return {'backlog'} end
if ARGV[4] == '1' then
  local outstanding = tonumber(st[3] or '0')
  for i = 4, 10 do outstanding = outstanding - tonumber(st[i] or '0') end
  local version = tonumber(st[2] or '0')
  if outstanding >= (version + tonumber(ARGV[5]) + 1) * tonumber(ARGV[6]) then
    return {'staleness'}
  end
end
local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1, 'STREAMS', KEYS[1], '>')
if not res then return {'empty'} end
local entry = res[1][2][1]
redis.call('HINCRBY', KEYS[3], '$ADMITTED', 1)
return {'ok', entry[1], entry[2], st[2] or '0'}
""")

# KEYS: prompts. ARGV: group, consumer, ids... Renews the lease of each id still
# owned by this consumer (XCLAIM JUSTID resets its idle time) and returns the ids it no longer
# owns: never steals back an entry another producer has taken over.
RENEW = _template("""
local lost = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
""")

# KEYS: prompts, state. ARGV: expected next index, next index after, epoch, position,
# dataset id, fields per entry, entries' fields... The feeder's XADD and its cursor move
# together, and only from the cursor it read: a re-sent or concurrent call adds nothing.
FEED = _template("""
local cur = redis.call('HGET', KEYS[2], '$FEED_NEXT_INDEX') or '0'
if cur ~= ARGV[1] then return false end
local width = tonumber(ARGV[6])
local added = 0
for i = 7, #ARGV, width do
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, i, i + width - 1))
  added = added + 1
end
redis.call('HSET', KEYS[2], '$FEED_NEXT_INDEX', ARGV[2], '$FEED_EPOCH', ARGV[3],
  '$FEED_POSITION', ARGV[4], '$FEED_DATASET', ARGV[5])
redis.call('HINCRBY', KEYS[2], '$FED', added)
return added
""")


# KEYS: dead, prompts, state. ARGV: dead entry id, counter, fields of the prompt entry...
# The dead stream has no consumer group, so XDEL's reply is the ownership check: only the call
# that deleted the entry re-adds it, and a re-sent or concurrent requeue adds nothing.
REQUEUE = _template("""
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 3))
redis.call('HINCRBY', KEYS[3], ARGV[2], 1)
return id
""")


_DEAD_LETTER_FIELDS = frozenset({"source", "reason", "entry_id", "ts_ms"})
"""Fields a dead-letter entry sets itself; an original field of the same name is dropped."""


def _field_name(name: str | bytes) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


# KEYS: lease. ARGV: token, ttl ms. Takes a free lease or renews our own; 0 when another holds it.
LEASE = """
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# KEYS: lease. ARGV: token. Deletes the lease only if we still hold it.
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


def _flatten(fields: Mapping[Any, Any]) -> list[Any]:
    out: list[Any] = []
    for key, value in fields.items():
        out.append(key)
        out.append(value)
    return out


class Scripts:
    """The scripts bound to one namespace and one client; redis-py reloads them on NOSCRIPT."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._publish = redis.register_script(PUBLISH)
        self._move = redis.register_script(MOVE)
        self._ack_delete = redis.register_script(ACK_DELETE)
        self._admit = redis.register_script(ADMIT)
        self._renew = redis.register_script(RENEW)
        self._feed = redis.register_script(FEED)
        self._requeue = redis.register_script(REQUEUE)
        self._lease = redis.register_script(LEASE)
        self._release = redis.register_script(RELEASE)

    async def publish(self, prompt_id: str | bytes, group_fields: Mapping[str, Any], now_ms: int) -> bytes | None:
        """Publish a group and ack its prompt; None when the prompt was already acknowledged."""
        k = self.keys
        result = await self._publish(
            keys=[k.prompts, k.groups, k.state],
            args=[PRODUCERS_GROUP, prompt_id, now_ms, *_flatten(group_fields)],
        )
        return result or None

    async def move(
        self,
        *,
        source: str,
        group: str,
        entry_id: str | bytes,
        target: str,
        counter: str,
        fields: Mapping[Any, Any],
    ) -> bool:
        """Ack + delete ``entry_id`` in ``source`` and add ``fields`` to ``target``, atomically."""
        result = await self._move(
            keys=[source, target, self.keys.state],
            args=[group, entry_id, counter, *_flatten(fields)],
        )
        return bool(result)

    async def recycle(self, group_id: str | bytes, counter: str, prompt_fields: Mapping[str, Any]) -> bool:
        k = self.keys
        return await self.move(
            source=k.groups, group=TRAINER_GROUP, entry_id=group_id, target=k.prompts,
            counter=counter, fields=prompt_fields,
        )

    async def return_prompt(self, prompt_id: str | bytes, prompt_fields: Mapping[Any, Any]) -> bool:
        k = self.keys
        return await self.move(
            source=k.prompts, group=PRODUCERS_GROUP, entry_id=prompt_id, target=k.prompts,
            counter=StateField.RETURNED, fields=prompt_fields,
        )

    async def dead_letter(
        self,
        *,
        source: str,
        group: str,
        entry_id: str | bytes,
        reason: str,
        fields: Mapping[Any, Any],
        now_ms: int,
    ) -> bool:
        """Move an entry to the dead-letter stream with a reason; its original fields are kept."""
        kind = "prompts" if source == self.keys.prompts else "groups"
        # Field names are kept as they came (bytes that are not UTF-8 included: a hostile entry
        # must be dead-lettered, not crash the process that reads it).
        original = {k: v for k, v in fields.items() if _field_name(k) not in _DEAD_LETTER_FIELDS}
        dead_fields = {"source": kind, "reason": reason, "entry_id": entry_id, "ts_ms": now_ms, **original}
        return await self.move(
            source=source, group=group, entry_id=entry_id, target=self.keys.dead,
            counter=StateField.DEAD, fields=dead_fields,
        )

    async def ack_delete(
        self,
        *,
        stream: str,
        group: str,
        ids: Sequence[str | bytes],
        counter: str,
        second_counter: str = "",
        time_field: str = "",
        now_ms: int = 0,
    ) -> int:
        if not ids:
            return 0
        return int(
            await self._ack_delete(
                keys=[stream, self.keys.state],
                args=[group, counter, second_counter, time_field, now_ms, *ids],
            )
        )

    async def admit(
        self,
        *,
        consumer: str,
        max_backlog: int,
        admission: bool,
        max_staleness: int,
        batch_size: int,
    ) -> tuple[str, bytes | None, dict[bytes, bytes] | None, int]:
        k = self.keys
        result = await self._admit(
            keys=[k.prompts, k.groups, k.state],
            args=[PRODUCERS_GROUP, consumer, max_backlog, 1 if admission else 0, max_staleness, batch_size],
        )
        status = result[0].decode() if isinstance(result[0], bytes) else result[0]
        if status != "ok":
            return status, None, None, 0
        flat = result[2] or []
        return status, result[1], dict(zip(flat[::2], flat[1::2], strict=True)), int(result[3])

    async def requeue(self, dead_id: str | bytes, prompt_fields: Mapping[str, Any]) -> bytes | None:
        """Move a dead-letter entry back to the prompt stream; None when it was already gone."""
        k = self.keys
        result = await self._requeue(
            keys=[k.dead, k.prompts, k.state], args=[dead_id, StateField.REQUEUED, *_flatten(prompt_fields)]
        )
        return result or None

    async def renew(self, consumer: str, ids: Iterable[str | bytes]) -> list[bytes]:
        ids = list(ids)
        if not ids:
            return []
        return list(
            await self._renew(keys=[self.keys.prompts], args=[PRODUCERS_GROUP, consumer, *ids])
        )

    async def feed(
        self,
        *,
        expected_next: int,
        next_after: int,
        epoch: int,
        position: int,
        dataset: str,
        entries: Sequence[Mapping[str, Any]],
    ) -> int | None:
        """Add prompt entries and move the cursor; None when the cursor moved meanwhile."""
        width = 2 * len(entries[0]) if entries else 0
        flat: list[Any] = []
        for fields in entries:
            if 2 * len(fields) != width:
                raise ValueError("every fed entry must have the same fields")
            flat.extend(_flatten(fields))
        result = await self._feed(
            keys=[self.keys.prompts, self.keys.state],
            args=[expected_next, next_after, epoch, position, dataset, width or 2, *flat],
        )
        return None if result is None else int(result)

    async def lease(self, key: str, token: str, ttl_ms: int) -> bool:
        """Take the lease ``key`` if free, or renew it if ``token`` holds it; False when another does."""
        return bool(await self._lease(keys=[key], args=[token, ttl_ms]))

    async def release(self, key: str, token: str) -> bool:
        """Delete the lease ``key`` if ``token`` still holds it."""
        return bool(await self._release(keys=[key], args=[token]))
