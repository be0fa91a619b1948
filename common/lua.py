"""The Lua scripts that make every hand-over atomic.

MULTI/EXEC cannot branch on a result, and every hand-over must: a prompt attempt ends in exactly
one of *group published*, *prompt recycled* or *dead-lettered*, and only the holder whose XACK
returned 1 may do that. Each script therefore starts with the XACK (or a cursor check) and
does nothing else when it finds the work already done, which also makes every script safe to
re-send after a dropped connection.

All keys of a script share the namespace hash tag, so the scripts run on Redis Cluster. The
fields of the ``state`` hash are written ``$NAME`` and filled in from :class:`~.keys.StateField`.

Each script is one :class:`Script` declaration: its source with the names of its KEYS and ARGV
(and the constant ARGV values), so a call names its arguments instead of ordering them, a KEYS
name that is a :class:`~.keys.Keys` property (``state``, ``groups``...) is filled in from the
namespace, and :class:`Scripts` binds every declaration of this module by itself
(``tests/test_unit_lua.py`` checks the names against the ``KEYS[i]``/``ARGV[i]`` the body uses).
A new script: its declaration here, a :class:`Scripts` method that runs it (``self._run``) and
shapes its reply, and the protocol method that calls that.

Longer than 500 lines on purpose: most of it is the Lua source of the scripts with the
reasoning each needs, and a script's declaration and its :class:`Scripts` method stay in one file
so that a script is read, and changed, in one place.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from string import Template
from typing import Any

from redis.asyncio import Redis

from .admission import MEASURED_CADENCE_CAP
from .config import PipelineConfig
from .keys import PRODUCERS_GROUP, TRAINER_GROUP, Keys, SourceField, StateField
from .redis_errors import translated

_STATE_FIELDS = {name: value for name, value in vars(StateField).items() if name.isupper() and isinstance(value, str)}


# Every script starts with these helpers: a value read back from Redis is parsed defensively
# (``num``: not a number -> 0), and a counter holding garbage (``HSET state committed abc``) is
# reset before HINCRBY, which would otherwise fail the whole hand-over.
_HELPERS = """
local function isint(v) return type(v) == 'string' and string.match(v, '^%-?%d+$') ~= nil end
local function num(v) if isint(v) then return tonumber(v) end return 0 end
local function group_exists(stream, group)  -- XACK answers 0 for a missing group: raise NOGROUP instead
  redis.call('XPENDING', stream, group)
end
local function incr(key, field, n)
  local v = redis.call('HGET', key, field)
  if v and not isint(v) then redis.call('HSET', key, field, 0) end
  return redis.call('HINCRBY', key, field, n)
end
-- The byte budget's ledger: the size of every group entry's data (hash ``sizes``) and their sum
-- in the state hash; ``forget`` removes one entry from both (never below zero).
local function forget(sizes, state, id)
  local b = num(redis.call('HGET', sizes, id))
  if b > 0 then
    redis.call('HDEL', sizes, id)
    if incr(state, 'GROUP_BYTES', -b) < 0 then redis.call('HSET', state, 'GROUP_BYTES', 0) end
  end
  return b
end
-- An episode journal (durable episodes) leaves with its prompt: its bytes leave the state hash's
-- ``journal_bytes`` in the same step. ``journal`` '' = the prompt has none to drop.
local function drop_journal(journal, state)
  if journal == '' then return end
  local b = num(redis.call('HGET', journal, 'bytes'))
  redis.call('DEL', journal)
  if b > 0 and incr(state, 'JOURNAL_BYTES', -b) < 0 then redis.call('HSET', state, 'JOURNAL_BYTES', 0) end
end
"""


# The archive of fates (DESIGN §4.19), used by the scripts that decide a fate: while the
# namespace's config has an ``archive_bytes`` budget, a copy of entry ``id`` of ``src`` goes to the
# archive stream with ``meta`` = {fate, reason, actor, step, position, kind, ts_ms} in front of
# its own fields, in the same step as the hand-over. The archive never refuses a hand-over: the
# oldest records are deleted (``archive_dropped``) until the new one fits; one larger than the
# whole budget is dropped itself. ``record_bytes`` is the record's size in the ledger.
_ARCHIVE = """
local function archive(cfg, akey, state, src, id, meta)
  local budget = num(redis.call('HGET', cfg, 'archive_bytes'))
  if budget <= 0 then return end
  local rows = redis.call('XRANGE', src, id, id)
  if #rows == 0 then return end
  local f = rows[1][2]
  local size = 64
  for i = 1, #f do size = size + #f[i] end
  for i = 1, #meta do size = size + #meta[i] end
  local held = num(redis.call('HGET', state, '$ARCHIVE_BYTES'))
  local dropped = 0
  while held > 0 and held + size > budget do
    local first = redis.call('XRANGE', akey, '-', '+', 'COUNT', 1)
    if #first == 0 then held = 0 break end
    local ff, fb = first[1][2], 0
    for i = 1, #ff - 1, 2 do if ff[i] == 'record_bytes' then fb = num(ff[i + 1]) break end end
    redis.call('XDEL', akey, first[1][1])
    held = math.max(0, held - fb)
    dropped = dropped + 1
  end
  if size > budget then
    dropped = dropped + 1
  else
    local version = redis.call('HGET', state, '$WEIGHT_VERSION') or '0'
    redis.call('XADD', akey, '*', 'fate', meta[1], 'reason', meta[2], 'actor', meta[3], 'step', meta[4],
      'position', meta[5], 'kind', meta[6], 'ts_ms', meta[7], 'trainer_version', version, 'entry_id', id,
      'record_bytes', size, unpack(f))
    held = held + size
    incr(state, '$ARCHIVE_RECORDED', 1)
  end
  redis.call('HSET', state, '$ARCHIVE_BYTES', held)
  if dropped > 0 then incr(state, '$ARCHIVE_DROPPED', dropped) end
end
"""


def _template(source: str) -> str:
    """A script with its ``$NAME`` placeholders replaced by the ``StateField`` names, once at import
    (an unknown name fails the import), after the helpers."""
    helpers = _HELPERS.replace("'GROUP_BYTES'", f"'{StateField.GROUP_BYTES}'").replace(
        "'JOURNAL_BYTES'", f"'{StateField.JOURNAL_BYTES}'")
    return helpers + Template(source).substitute(_STATE_FIELDS)


@dataclass(frozen=True, slots=True)
class Script:
    """One Lua script: the names of its KEYS and ARGV in the order the body indexes them, the
    constant ARGV values (``defaults``) and its source. An ARGV name starting with ``*`` is the
    variadic rest (a sequence, spread)."""

    name: str
    keys: tuple[str, ...]
    argv: tuple[str, ...]
    source: str
    defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [*self.keys, *(a.lstrip("*") for a in self.argv)]
        if len(set(names)) != len(names):
            raise ValueError(f"script {self.name}: a KEYS or ARGV name is used twice: {names}")
        if any(a.startswith("*") for a in (*self.keys, *self.argv[:-1])):
            raise ValueError(f"script {self.name}: only the last ARGV name may be variadic (*name)")
        if unknown := set(self.defaults) - set(names):
            raise ValueError(f"script {self.name}: defaults for undeclared names {sorted(unknown)}")

    @property
    def names(self) -> frozenset[str]:
        """Every argument a call may name: the KEYS and ARGV names."""
        return frozenset((*self.keys, *(a.lstrip("*") for a in self.argv)))

    def lists(self, namespace: Keys, named: Mapping[str, Any]) -> tuple[list[Any], list[Any]]:
        """(KEYS, ARGV) for a call naming its arguments; a KEYS name left out that is a ``Keys``
        property is that key of ``namespace``. TypeError for a missing or unknown name."""
        given = {**self.defaults, **named}
        if unknown := given.keys() - self.names:
            raise TypeError(f"script {self.name}: unknown argument(s) {sorted(unknown)}")
        keys: list[Any] = []
        for name in self.keys:
            if name in given:
                keys.append(given[name])
            elif isinstance(getattr(Keys, name, None), property):
                keys.append(getattr(namespace, name))
            else:
                raise TypeError(f"script {self.name}: missing key {name!r}")
        args: list[Any] = []
        for name in self.argv:
            if name.startswith("*"):
                args.extend(given.get(name[1:], ()))
            elif name in given:
                args.append(given[name])
            else:
                raise TypeError(f"script {self.name}: missing argument {name!r}")
        return keys, args


# A group published and its prompt (an entry of ``source``: prompts or retry) acknowledged; the
# group's size goes into the byte ledger in the same step as the group, and the prompt's episode
# journal (``journal``, durable episodes; ``drop`` '1') is deleted in it too.
PUBLISH = Script(
    "PUBLISH",
    keys=("source", "groups", "state", "group_bytes", "journal", "sources"),
    argv=("group", "prompt_id", "now_ms", "data_bytes", "drop", "tally", "*fields"),
    defaults={"tally": ""},
    source=_template("""
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  group_exists(KEYS[1], ARGV[1])
  incr(KEYS[3], '$DUPLICATES', 1)
  return false
end
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[5] == '1' then drop_journal(KEYS[5], KEYS[3]) end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 7))
incr(KEYS[3], '$PUBLISHED', 1)
if ARGV[6] ~= '' then incr(KEYS[6], ARGV[6], 1) end
local b = tonumber(ARGV[4]) or 0
if b > 0 then
  redis.call('HSET', KEYS[4], id, b)
  incr(KEYS[3], '$GROUP_BYTES', b)
  incr(KEYS[3], '$PUBLISHED_BYTES', b)
end
redis.call('HSET', KEYS[3], '$LAST_PUBLISH_MS', ARGV[3])
return id
"""),
)

# ``ledger``: '' = neither stream is the group stream, 's' = the source is, 'st' = both are.
# Acknowledges and deletes an entry of the source stream and adds a new entry to the target
# stream: a prompt recycled (groups -> retry), returned (prompts/retry -> retry), dead-lettered
# (any -> dead) or a group released (groups -> groups); a group leaving the stream leaves the
# byte ledger with it. ``fate`` ('recycled', 'dead_lettered' or '' = none) is archived first
# (``_ARCHIVE``), by ``actor`` from the ``kind`` of stream it left. ``drop`` '1': the prompt's
# episode journal (``journal``) is deleted in the same step (a dead letter); a returned prompt
# keeps it for the producer that takes it over.
MOVE = Script(
    "MOVE",
    keys=("source", "target", "state", "group_bytes", "config", "archive", "journal", "sources"),
    argv=("group", "entry_id", "counter", "ledger", "fate", "reason", "actor", "kind", "now_ms", "drop", "tally",
          "*fields"),
    defaults={"tally": ""},
    source=_template(_ARCHIVE + """
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then
  group_exists(KEYS[1], ARGV[1])
  return false
end
if ARGV[5] ~= '' then
  archive(KEYS[5], KEYS[6], KEYS[3], KEYS[1], ARGV[2],
    {ARGV[5], ARGV[6], ARGV[7], '', '', ARGV[8], ARGV[9]})
end
redis.call('XDEL', KEYS[1], ARGV[2])
if ARGV[10] == '1' then drop_journal(KEYS[7], KEYS[3]) end
local b = 0
if ARGV[4] ~= '' then b = forget(KEYS[4], KEYS[3], ARGV[2]) end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 12))
if ARGV[4] == 'st' and b > 0 then
  redis.call('HSET', KEYS[4], id, b)
  incr(KEYS[3], '$GROUP_BYTES', b)
end
incr(KEYS[3], ARGV[3], 1)
if ARGV[11] ~= '' then incr(KEYS[8], ARGV[11], 1) end
return id
"""),
)

# ``second_counter`` and ``time_field`` may be ''. Acknowledges and deletes entries (commit, filtered drop);
# counts the acknowledged ones only, and takes those out of the byte ledger (an id the ledger
# does not hold, e.g. a prompt's, changes nothing). ``fate`` ('trained', 'filtered' or '' = none)
# is archived for each acknowledged group first (``_ARCHIVE``); a commit that acknowledged any is
# one more trained step (``trained_steps``: the records' ``step``, ``position`` = order in it).
ACK_DELETE = Script(
    "ACK_DELETE",
    keys=("stream", "state", "sizes", "config", "archive", "sources"),
    argv=("group", "counter", "second_counter", "time_field", "now_ms", "fate", "reason", "actor", "tally", "*ids"),
    defaults={"tally": ""},
    source=_template(_ARCHIVE + """
local acked = 0
local step = ''
local tally = {}
if ARGV[9] ~= '' then tally = cjson.decode(ARGV[9]) end
if ARGV[6] == 'trained' then step = tostring(num(redis.call('HGET', KEYS[2], '$TRAINED_STEPS')) + 1) end
for i = 10, #ARGV do
  if redis.call('XACK', KEYS[1], ARGV[1], ARGV[i]) == 1 then
    acked = acked + 1
    local field = tally[i - 9]
    if field and field ~= '' then incr(KEYS[6], field, 1) end
    if ARGV[6] ~= '' then
      local position = ''
      if step ~= '' then position = tostring(i - 10) end
      archive(KEYS[4], KEYS[5], KEYS[2], KEYS[1], ARGV[i],
        {ARGV[6], ARGV[7], ARGV[8], step, position, 'groups', ARGV[5]})
    end
    redis.call('XDEL', KEYS[1], ARGV[i])
    if KEYS[3] ~= KEYS[1] then forget(KEYS[3], KEYS[2], ARGV[i]) end
  end
end
if acked == 0 then group_exists(KEYS[1], ARGV[1]) end
if acked > 0 then
  incr(KEYS[2], ARGV[2], acked)
  if ARGV[3] ~= '' then incr(KEYS[2], ARGV[3], acked) end
  if step ~= '' then redis.call('HSET', KEYS[2], '$TRAINED_STEPS', step) end
end
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[4], ARGV[5]) end
return acked
"""),
)

# A finished eval's groups (entries of ``eval_groups``) archived as ``evaluated`` (reason: the
# eval's name) and deleted, and its result stored, in one step: a re-sent call finds them gone.
EVAL_COLLECT = Script(
    "EVAL_COLLECT",
    keys=("eval_groups", "evals", "state", "config", "archive"),
    argv=("name", "result", "actor", "now_ms", "*ids"),
    source=_template(_ARCHIVE + """
for i = 5, #ARGV do
  archive(KEYS[4], KEYS[5], KEYS[3], KEYS[1], ARGV[i], {'evaluated', ARGV[1], ARGV[3], '', '', 'eval_groups', ARGV[4]})
  redis.call('XDEL', KEYS[1], ARGV[i])
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return #ARGV - 4
"""),
)

# The archiver's confirmation: ``pairs`` are (archive id, record size) of records written to
# Parquet; each one still in the stream is deleted and leaves the ledger (one the budget dropped
# meanwhile changes nothing). ``cursor`` is the last id written, for ``inspect``.
ARCHIVED = Script(
    "ARCHIVED",
    keys=("archive", "state"),
    argv=("cursor", "now_ms", "*pairs"),
    source=_template("""
local gone, freed = 0, 0
for i = 3, #ARGV - 1, 2 do
  if redis.call('XDEL', KEYS[1], ARGV[i]) == 1 then
    gone = gone + 1
    freed = freed + num(ARGV[i + 1])
  end
end
if freed > 0 and incr(KEYS[2], '$ARCHIVE_BYTES', -freed) < 0 then redis.call('HSET', KEYS[2], '$ARCHIVE_BYTES', 0) end
if gone > 0 then incr(KEYS[2], '$ARCHIVED', gone) end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[2], '$ARCHIVE_CURSOR', ARGV[1]) end
redis.call('HSET', KEYS[2], '$ARCHIVE_SEEN_MS', ARGV[2])
return gone
"""),
)

# Shared by ADMIT and SET_VERSION: a consumer group's pending count (0 when the stream or group
# does not exist). XINFO GROUPS, not XPENDING: XPENDING's summary walks every consumer of the
# group and lists each one's count (two per producer in ADMIT, which every producer runs for
# every group it starts), XINFO GROUPS reads each group's pending-list size once (O(groups):
# one group per stream). docs/scale.md has the before/after.
_PENDING = """
local function pending(key, group)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return 0 end
  for _, g in ipairs(groups) do
    for i = 1, #g - 1, 2 do
      if g[i] == 'name' and g[i + 1] ~= group then break end
      if g[i] == 'pending' then return tonumber(g[i + 1]) or 0 end
    end
  end
  return 0
end
"""

# ``admission``: 1/0; S = ``max_staleness``, B = ``batch_size``, K = ``steps_per_version``,
# cap = ``cadence_cap``. Returns {reason, ...} or {'ok', weight version, (stream index, id, fields)...}: reads up to
# ``count`` prompts, retry stream first (stream index 1) then prompts (2), and counts them as
# admitted, only when the pipeline is not paused, the READY backlog (XLEN groups - pending in
# groups) is under its cap and (with admission control) outstanding < capacity, where
#   outstanding = pending(retry) + pending(prompts) + ready
#   c = max(0, committed + pending(groups) - version_start_consumed)
#   G = max(K * B, min(prev_version_consumed, cap * K * B))
#   capacity = max(1, (S + 1) * G - min(c, G))
# (the same arithmetic as common/admission.py); then reads at most capacity - outstanding, and
# at most max_backlog - ready (a burst never overshoots the backlog cap by more than one read).
# With a byte budget (``max_backlog_bytes`` > 0) and groups ready, the bytes held in the group stream plus the
# prompts in flight at the mean group size must stay under it:
#   projected = group_bytes + (pending(retry) + pending(prompts)) * mean, mean = published_bytes / published
# and one more group of the mean size must fit (projected + mean <= budget); at most
# (budget - projected) / mean are read. With no group ready the budget does not
# refuse: a trainer waiting inside take() for a batch larger than the budget must get it.
# Refusals: {'paused'}, {'backlog', ready}, {'backlog_bytes', projected, budget},
# {'staleness', outstanding, capacity, c, G}, {'empty'}.
ADMIT = Script(
    "ADMIT",
    keys=("retry", "prompts", "groups", "state", "eval_prompts"),
    argv=(
        "group", "consumer", "max_backlog", "admission", "max_staleness", "batch_size", "steps_per_version",
        "count", "trainer_group", "cadence_cap", "now_ms", "max_backlog_bytes",
    ),
    defaults={"group": PRODUCERS_GROUP, "trainer_group": TRAINER_GROUP, "cadence_cap": MEASURED_CADENCE_CAP},
    source=_template(_PENDING + """
local st = redis.call('HMGET', KEYS[4], '$PAUSED', '$WEIGHT_VERSION', '$COMMITTED',
  '$VERSION_START_CONSUMED', '$PREV_VERSION_CONSUMED', '$GROUP_BYTES', '$PUBLISHED_BYTES', '$PUBLISHED')
if st[1] == '1' then return {'paused'} end
-- The eval lane first (stream index 3): its groups never enter the group stream, so neither the
-- backlog, the byte budget nor the staleness rule holds it back; a round that admits eval
-- prompts admits nothing else. pcall: a namespace of an older version has no eval stream yet.
local ev = redis.pcall('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', tonumber(ARGV[8]), 'STREAMS', KEYS[5], '>')
if type(ev) == 'table' and ev[1] and ev[1][2] and #ev[1][2] > 0 then
  local out = {'ok', tostring(math.max(0, num(st[2])))}
  for _, entry in ipairs(ev[1][2]) do
    table.insert(out, 3)
    table.insert(out, entry[1])
    table.insert(out, entry[2])
  end
  return out
end
local taken = pending(KEYS[3], ARGV[9])
local ready = math.max(0, redis.call('XLEN', KEYS[3]) - taken)
if ready >= tonumber(ARGV[3]) then return {'backlog', ready} end
local room = math.min(tonumber(ARGV[8]), tonumber(ARGV[3]) - ready)
local in_flight = pending(KEYS[1], ARGV[1]) + pending(KEYS[2], ARGV[1])
local budget = tonumber(ARGV[12]) or 0
if budget > 0 and ready > 0 then
  local mean = 0
  if num(st[8]) > 0 then mean = math.ceil(num(st[7]) / num(st[8])) end
  local projected = num(st[6]) + in_flight * mean
  if projected + math.max(mean, 1) > budget then return {'backlog_bytes', projected, budget} end
  if mean > 0 then room = math.min(room, math.floor((budget - projected) / mean)) end
end
if ARGV[4] == '1' then
  local outstanding = in_flight + ready
  local c = math.max(0, num(st[3]) + taken - num(st[4]))
  local declared = tonumber(ARGV[7]) * tonumber(ARGV[6])
  local g = math.max(declared, math.min(num(st[5]), tonumber(ARGV[10]) * declared))
  local capacity = math.max(1, (tonumber(ARGV[5]) + 1) * g - math.min(c, g))
  if outstanding >= capacity then return {'staleness', outstanding, capacity, c, g} end
  room = math.min(room, capacity - outstanding)
end
local out = {'ok', tostring(math.max(0, num(st[2])))}
local got = 0
for i = 1, 2 do
  if got >= room then break end
  local res = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', room - got, 'STREAMS', KEYS[i], '>')
  if res then
    for _, entry in ipairs(res[1][2]) do
      table.insert(out, i)
      table.insert(out, entry[1])
      table.insert(out, entry[2])
      got = got + 1
    end
  end
end
if got == 0 then return {'empty'} end
incr(KEYS[4], '$ADMITTED', got)
redis.call('HSET', KEYS[4], '$LAST_ADMIT_MS', ARGV[11])
return out
"""),
)

# ``version`` '' = unchanged, ``paused`` '1', '0' or '' = unchanged. A version change records
# where the new version began (version_start_consumed = committed + taken) and what the previous one consumed
# (prev_version_consumed), in the same step as the version itself: the terms of ADMIT's rule.
SET_VERSION = Script(
    "SET_VERSION",
    keys=("state", "groups"),
    argv=("version", "paused", "channel", "message", "trainer_group"),
    defaults={"trainer_group": TRAINER_GROUP},
    source=_template(_PENDING + """
if ARGV[1] ~= '' then
  local st = redis.call('HMGET', KEYS[1], '$WEIGHT_VERSION', '$COMMITTED', '$VERSION_START_CONSUMED')
  if st[1] == false or num(st[1]) ~= tonumber(ARGV[1]) then
    local consumed = num(st[2]) + pending(KEYS[2], ARGV[5])
    redis.call('HSET', KEYS[1], '$VERSION_START_CONSUMED', consumed,
      '$PREV_VERSION_CONSUMED', math.max(0, consumed - num(st[3])))
  end
  redis.call('HSET', KEYS[1], '$WEIGHT_VERSION', ARGV[1])
end
if ARGV[2] ~= '' then redis.call('HSET', KEYS[1], '$PAUSED', ARGV[2]) end
redis.call('PUBLISH', ARGV[3], ARGV[4])
return true
"""),
)

# ``stream``: prompts or retry. Renews the lease of each id still
# owned by this consumer (XCLAIM JUSTID resets its idle time) and returns the ids it no longer
# owns: never steals back an entry another producer has taken over.
RENEW = Script(
    "RENEW",
    keys=("stream",),
    argv=("group", "consumer", "*ids"),
    defaults={"group": PRODUCERS_GROUP},
    source=_template("""
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
"""),
)

# The fleet's reclaim turn: the first producer to call it
# an interval after the last turn takes it (returns 1) and looks for idle prompts; every call
# also returns when idle prompts were last found (reclaim_due_ms), so the others take them over.
# A turn stamped far in the future (a producer's clock ahead) is taken over too.
RECLAIM_TURN = Script(
    "RECLAIM_TURN",
    keys=("state",),
    argv=("now_ms", "interval_ms"),
    source=_template("""
local st = redis.call('HMGET', KEYS[1], '$RECLAIM_TURN_MS', '$RECLAIM_DUE_MS')
local now, interval, last = tonumber(ARGV[1]), tonumber(ARGV[2]), num(st[1])
local won = 0
if now - last >= interval or last - now > interval then
  redis.call('HSET', KEYS[1], '$RECLAIM_TURN_MS', ARGV[1])
  won = 1
end
return {won, num(st[2])}
"""),
)

# ``width``: fields per entry (names and values), ``entries``: all entries' fields, ``rejected``: a
# JSON list of dead letters (flat field lists) for rows that cannot be fed, ``updates``: a JSON
# list of (op, field, value) for the ``sources`` hash (op 's': HSET, 'i': add), the named sources'
# cursors and fed counts. The feeder's
# XADD and its cursor move together, and only from the cursor it read: a re-sent or concurrent call adds nothing.
FEED = Script(
    "FEED",
    keys=("prompts", "state", "dead", "sources"),
    argv=("expected_next", "next_after", "epoch", "position", "dataset", "rejected", "updates", "width", "*entries"),
    source=_template("""
local cur = redis.call('HGET', KEYS[2], '$FEED_NEXT_INDEX') or '0'
if cur ~= ARGV[1] then return false end
local dead = cjson.decode(ARGV[6])
for _, fields in ipairs(dead) do
  redis.call('XADD', KEYS[3], '*', unpack(fields))
end
incr(KEYS[2], '$DEAD', #dead)
local updates = cjson.decode(ARGV[7])
for i = 1, #updates, 3 do
  if updates[i] == 'i' then incr(KEYS[4], updates[i + 1], tonumber(updates[i + 2]))
  else redis.call('HSET', KEYS[4], updates[i + 1], updates[i + 2]) end
end
local width = tonumber(ARGV[8])
local added = 0
for i = 9, #ARGV, width do
  redis.call('XADD', KEYS[1], '*', unpack(ARGV, i, i + width - 1))
  added = added + 1
end
redis.call('HSET', KEYS[2], '$FEED_NEXT_INDEX', ARGV[2], '$FEED_EPOCH', ARGV[3],
  '$FEED_POSITION', ARGV[4], '$FEED_DATASET', ARGV[5])
incr(KEYS[2], '$FED', added)
return added
"""),
)


# A delivered group found gone
# from the stream (XTRIM, XDEL): acknowledged, and out of the byte ledger.
FORGET = Script(
    "FORGET",
    keys=("groups", "state", "group_bytes"),
    argv=("group", "entry_id"),
    defaults={"group": TRAINER_GROUP},
    source=_template("""
if redis.call('XACK', KEYS[1], ARGV[1], ARGV[2]) == 0 then group_exists(KEYS[1], ARGV[1]) end
return forget(KEYS[3], KEYS[2], ARGV[2])
"""),
)

# One finished step of an episode (durable episodes), appended to its prompt's journal only while
# ``consumer`` holds the prompt attempt's lease (the entry ``entry_id`` of ``source`` is pending
# under its name): a producer whose prompt was taken over writes nothing. Step ``seq`` of
# ``member`` replaces that member's steps from ``seq`` on (a replay that diverged drops the rest;
# a re-sent append rewrites the same step). ``budget`` > 0: the bytes of the groups held plus the
# journals may not pass it, else nothing is written ('full'). Returns 'ok', 'lost' or 'full'.
JOURNAL_APPEND = Script(
    "JOURNAL_APPEND",
    keys=("source", "journal", "state"),
    argv=("group", "consumer", "entry_id", "member", "seq", "budget", "step"),
    defaults={"group": PRODUCERS_GROUP},
    source=_template("""
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if not p[1] or p[1][2] ~= ARGV[2] then return 'lost' end
local m, seq = ARGV[4], tonumber(ARGV[5])
local count = num(redis.call('HGET', KEYS[2], 'n:' .. m))
local freed = 0
for s = seq, count - 1 do
  local f = m .. ':' .. s
  freed = freed + redis.call('HSTRLEN', KEYS[2], f)
  redis.call('HDEL', KEYS[2], f)
end
local size = string.len(ARGV[7])
local budget = tonumber(ARGV[6]) or 0
local st = redis.call('HMGET', KEYS[3], '$GROUP_BYTES', '$JOURNAL_BYTES')
local status = 'ok'
if budget > 0 and num(st[1]) + num(st[2]) - freed + size > budget then
  size = 0
  status = 'full'
  if seq < count then redis.call('HSET', KEYS[2], 'n:' .. m, seq) end
else
  redis.call('HSET', KEYS[2], m .. ':' .. seq, ARGV[7], 'n:' .. m, seq + 1)
  incr(KEYS[3], '$JOURNAL_STEPS', 1)
end
if size - freed ~= 0 then
  redis.call('HINCRBY', KEYS[2], 'bytes', size - freed)
  if incr(KEYS[3], '$JOURNAL_BYTES', size - freed) < 0 then redis.call('HSET', KEYS[3], '$JOURNAL_BYTES', 0) end
end
return status
"""),
)

# Namespace-wide limits and rates use Redis' own clock (TIME), so producers on hosts whose clocks
# differ share one. Redis 6.2 needs effects replication for a write after TIME (7+ always does it).
_NOW = """
pcall(function() redis.replicate_commands() end)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""

# One unit of the namespace limit ``name`` for ``token`` (a producer's episode), leased until
# now + ``lease_ms``: expired holders (a killed producer's) are dropped first, so their units come
# back within the lease. The limit's size is the ``limits`` hash's, else ``size_hint`` (the size
# the producer last read: a Redis that restarted without the hash does not block anyone); 0 =
# unknown. Granted: the wait (``waited_ms``) and the most holders at once go to ``limit_stats``.
# Refused: the token is listed as a waiter (leased as well). Returns {'ok'|'wait'|'unknown', size}.
LIMIT_ACQUIRE = Script(
    "LIMIT_ACQUIRE",
    keys=("limits", "holders", "waiters", "limit_stats"),
    argv=("name", "token", "lease_ms", "size_hint", "waited_ms"),
    source=_template(_NOW + """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now)
local size = tonumber(redis.call('HGET', KEYS[1], 'limit:' .. ARGV[1]) or '') or tonumber(ARGV[4]) or 0
if size <= 0 then return {'unknown', 0} end
local expiry = now + tonumber(ARGV[3])
if redis.call('ZSCORE', KEYS[2], ARGV[2]) then
  redis.call('ZADD', KEYS[2], expiry, ARGV[2])
  return {'ok', size}
end
local held = redis.call('ZCARD', KEYS[2])
if held >= size then
  redis.call('ZADD', KEYS[3], expiry, ARGV[2])
  return {'wait', size}
end
redis.call('ZADD', KEYS[2], expiry, ARGV[2])
redis.call('ZREM', KEYS[3], ARGV[2])
incr(KEYS[4], 'acquired:' .. ARGV[1], 1)
incr(KEYS[4], 'wait_ms:' .. ARGV[1], tonumber(ARGV[5]) or 0)
if held + 1 > num(redis.call('HGET', KEYS[4], 'peak:' .. ARGV[1])) then
  redis.call('HSET', KEYS[4], 'peak:' .. ARGV[1], held + 1)
end
return {'ok', size}
"""),
)

# Extends the leases of ``tokens`` still holding a unit of one limit; returns the ones that lost
# theirs (expired: the producer's loop or network stalled past the lease).
LIMIT_RENEW = Script(
    "LIMIT_RENEW",
    keys=("holders",),
    argv=("lease_ms", "*tokens"),
    source=_template(_NOW + """
local lost = {}
for i = 2, #ARGV do
  local score = redis.call('ZSCORE', KEYS[1], ARGV[i])
  if score and tonumber(score) > now then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[1]), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""),
)

# One token of the namespace rate ``name`` (tokens per second from the ``limits`` hash, else
# ``rate_hint``; a burst of one second's worth, at least 1). Returns {'ok', 0}, {'wait', ms until a
# token is due} or {'unknown', 0}; a token taken counts in ``limit_stats`` with the wait before it.
RATE_TAKE = Script(
    "RATE_TAKE",
    keys=("limits", "bucket", "limit_stats"),
    argv=("name", "rate_hint", "waited_ms"),
    source=_template(_NOW + """
local rate = tonumber(redis.call('HGET', KEYS[1], 'rate:' .. ARGV[1]) or '') or tonumber(ARGV[2]) or 0
if rate <= 0 then return {'unknown', 0} end
local burst = math.max(1, rate)
local b = redis.call('HMGET', KEYS[2], 'tokens', 'ts_ms')
local tokens, ts = tonumber(b[1]), tonumber(b[2])
if tokens == nil or ts == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
if tokens >= 1 then
  redis.call('HSET', KEYS[2], 'tokens', tostring(tokens - 1), 'ts_ms', now)
  incr(KEYS[3], 'taken:' .. ARGV[1], 1)
  incr(KEYS[3], 'rate_wait_ms:' .. ARGV[1], tonumber(ARGV[3]) or 0)
  return {'ok', 0}
end
redis.call('HSET', KEYS[2], 'tokens', tostring(tokens), 'ts_ms', now)
return {'wait', math.ceil((1 - tokens) * 1000 / rate)}
"""),
)

# Per-row statistics for a curriculum: ``items`` are (field, mean reward, reward variance, version,
# epoch) of finished groups; each row's JSON keeps its count and the last ``k`` means and variances.
ROW_STATS = Script(
    "ROW_STATS",
    keys=("rows",),
    argv=("k", "*items"),
    source=_template("""
local k = tonumber(ARGV[1])
for i = 2, #ARGV - 4, 5 do
  local s = nil
  local raw = redis.call('HGET', KEYS[1], ARGV[i])
  if raw then
    local ok, decoded = pcall(cjson.decode, raw)
    if ok and type(decoded) == 'table' then s = decoded end
  end
  if not s then s = {} end
  local r, v = s.r, s.v
  if type(r) ~= 'table' then r = {} end
  if type(v) ~= 'table' then v = {} end
  table.insert(r, tonumber(ARGV[i + 1]) or 0)
  table.insert(v, tonumber(ARGV[i + 2]) or 0)
  while #r > k do table.remove(r, 1) end
  while #v > k do table.remove(v, 1) end
  redis.call('HSET', KEYS[1], ARGV[i], cjson.encode({t = (tonumber(s.t) or 0) + 1, r = r, v = v,
    w = tonumber(ARGV[i + 3]) or 0, e = tonumber(ARGV[i + 4]) or 0}))
end
return math.floor((#ARGV - 1) / 5)
"""),
)

# The dead stream has no consumer group, so XDEL's reply is the ownership check: only the call
# that deleted the entry re-adds it, and a re-sent or concurrent requeue adds nothing.
REQUEUE = Script(
    "REQUEUE",
    keys=("dead", "retry", "state", "sources"),
    argv=("dead_id", "counter", "tally", "*fields"),
    defaults={"tally": ""},
    source=_template("""
if redis.call('XDEL', KEYS[1], ARGV[1]) == 0 then
  return false
end
local id = redis.call('XADD', KEYS[2], '*', unpack(ARGV, 4))
incr(KEYS[3], ARGV[2], 1)
if ARGV[3] ~= '' then incr(KEYS[4], ARGV[3], 1) end
return id
"""),
)


# Takes a free lease or renews our own; 0 when another holds it.
# A renewal is a PEXPIRE, which Redis allows at maxmemory (SET is refused there), so a trainer
# keeps its name while Redis is out of memory.
LEASE = Script(
    "LEASE",
    keys=("lease",),
    argv=("token", "ttl_ms"),
    source="""
local holder = redis.call('GET', KEYS[1])
if holder and holder ~= ARGV[1] then return 0 end
if holder then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
""",
)

# Deletes the lease only if we still hold it.
RELEASE = Script(
    "RELEASE",
    keys=("lease",),
    argv=("token",),
    source="""
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
""",
)

SCRIPTS: tuple[Script, ...] = tuple(value for value in list(globals().values()) if isinstance(value, Script))
"""Every script declared in this module, bound by :class:`Scripts` (found, never listed by hand)."""


@dataclass(frozen=True, slots=True)
class AdmitReply:
    """ADMIT's answer: ``ok`` with entries (source stream key, id, fields) and the trainer's
    version, else a refusal with its numbers (``backlog``: ready; ``staleness``: outstanding,
    capacity, c, G) and no version (None: a refusal never reads one, so it must not pass for 0)."""

    status: str
    weight_version: int | None
    entries: list[tuple[str, bytes, dict[bytes, bytes]]]
    terms: list[int]


_DEAD_LETTER_FIELDS = frozenset({"source", "reason", "entry_id", "ts_ms"})
"""Fields a dead-letter entry sets itself; an original field of the same name is dropped."""


def _tally(fields: Mapping[Any, Any], kind: str) -> str:
    """The ``sources`` counter an entry of a named source moves (its plain ``source`` field), or ''."""
    source = fields.get("source", fields.get(b"source", ""))
    name = source.decode("utf-8", "replace") if isinstance(source, bytes) else str(source)
    return SourceField.of(name, kind) if name else ""


def _field_name(name: str | bytes) -> str:
    return name.decode("utf-8", "replace") if isinstance(name, bytes) else name


def _flatten(fields: Mapping[Any, Any]) -> list[Any]:
    out: list[Any] = []
    for key, value in fields.items():
        out.append(key)
        out.append(value)
    return out


def script_commands(script: Script | str) -> tuple[str, ...]:
    """The Redis commands a script calls, in order of first use (the helpers' included)."""
    source = script.source if isinstance(script, Script) else script
    return tuple(dict.fromkeys(re.findall(r"redis\.p?call\('([A-Z]+)'", source)))


class _Bound:
    """One script on one client, its NOPERM and OOM replies translated (naming the script and the
    commands it calls: Redis 6.2 does not say which one was refused)."""

    def __init__(self, redis: Redis, script: Script) -> None:
        self.redis = redis
        self.script = script
        self.commands = script_commands(script)
        self._script = redis.register_script(script.source)

    async def __call__(self, *, keys: Sequence[Any], args: Sequence[Any]) -> Any:
        s = self.script
        with translated(self.redis, script=s.name, commands=self.commands, source=s.source):
            return await self._script(keys=keys, args=args)


class Scripts:
    """Every script of this module (:data:`SCRIPTS`) bound to one namespace and one client;
    redis-py reloads them on NOSCRIPT. Each method runs one script by its declaration
    (:meth:`_run`, arguments by name) and shapes its reply."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._bound = {script.name: _Bound(redis, script) for script in SCRIPTS}

    async def _run(self, script: Script, **named: Any) -> Any:
        keys, args = script.lists(self.keys, named)
        return await self._bound[script.name](keys=keys, args=args)

    async def publish(
        self, source: str, prompt_id: str | bytes, group_fields: Mapping[str, Any], now_ms: int,
        journal: str | None = None,
    ) -> bytes | None:
        """Publish a group and ack its prompt (an entry of ``source``: prompts or retry); None when
        the prompt was already acknowledged. The size of its ``data`` enters the byte ledger; the
        prompt's episode ``journal`` (if any) is deleted with it. A prompt of the eval lane
        publishes to ``eval_groups``, outside the ledger and the sources' counters."""
        lane = source == self.keys.eval_prompts
        result = await self._run(
            PUBLISH, source=source, group=PRODUCERS_GROUP, prompt_id=prompt_id, now_ms=now_ms,
            groups=self.keys.eval_groups if lane else self.keys.groups,
            data_bytes=0 if lane else len(group_fields.get("data", b"")), fields=_flatten(group_fields),
            journal=journal or self.keys.state, drop="1" if journal else "",
            tally="" if lane else _tally(group_fields, "published"),
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
        fate: str = "",
        reason: str = "",
        actor: str = "",
        now_ms: int = 0,
        journal: str | None = None,
        tally: str = "",
    ) -> bool:
        """Ack + delete ``entry_id`` in ``source`` and add ``fields`` to ``target``, atomically
        (the byte ledger follows a group entry out of, or within, the group stream; a ``fate``
        is archived, decided by ``actor``, in the same step; the prompt's episode ``journal``, if
        given, is deleted in it too; ``tally``, a field of the ``sources`` hash, counts one more)."""
        k = self.keys
        groups = k.groups
        ledger = ("s" if source == groups else "") + ("t" if source == target == groups else "")
        kind = "groups" if source == groups else "retry" if source == k.retry else "prompts"
        moved = await self._run(
            MOVE, source=source, target=target, group=group, entry_id=entry_id, counter=counter,
            ledger=ledger, fate=fate, reason=reason, actor=actor, kind=kind, now_ms=now_ms,
            fields=_flatten(fields), journal=journal or k.state, drop="1" if journal else "", tally=tally,
        )
        return bool(moved)

    async def recycle(
        self, group_id: str | bytes, counter: str, prompt_fields: Mapping[str, Any], *,
        reason: str = "", actor: str = "", now_ms: int = 0,
    ) -> bool:
        """A group's prompt back to the retry stream (archived as ``recycled`` with ``reason``)."""
        k = self.keys
        return await self.move(
            source=k.groups, group=TRAINER_GROUP, entry_id=group_id, target=k.retry,
            counter=counter, fields=prompt_fields, fate="recycled", reason=reason or counter,
            actor=actor, now_ms=now_ms, tally=_tally(prompt_fields, "recycled"),
        )

    async def return_prompt(self, source: str, prompt_id: str | bytes, prompt_fields: Mapping[Any, Any]) -> bool:
        """A draining producer's unfinished prompt (an entry of ``source``) to the retry stream (an
        eval prompt back to the eval lane)."""
        k = self.keys
        return await self.move(
            source=source, group=PRODUCERS_GROUP, entry_id=prompt_id,
            target=k.eval_prompts if source == k.eval_prompts else k.retry,
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
        actor: str = "",
        journal: str | None = None,
    ) -> bool:
        """Move an entry to the dead-letter stream with a reason; its original fields are kept
        (and it is archived as ``dead_lettered``, decided by ``actor``; a prompt's episode
        ``journal`` is deleted)."""
        kind = "groups" if source == self.keys.groups else "prompts"
        # Field names are kept as they came (bytes that are not UTF-8 included: a hostile entry
        # must be dead-lettered, not crash the process that reads it).
        original = {k: v for k, v in fields.items() if _field_name(k) not in _DEAD_LETTER_FIELDS}
        dead_fields = {"source": kind, "reason": reason, "entry_id": entry_id, "ts_ms": now_ms, **original}
        return await self.move(
            source=source, group=group, entry_id=entry_id, target=self.keys.dead,
            counter=StateField.DEAD, fields=dead_fields, fate="dead_lettered", reason=reason, actor=actor,
            now_ms=now_ms, journal=journal, tally=_tally(fields, "lost"),
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
        fate: str = "",
        reason: str = "",
        actor: str = "",
        tally: Sequence[str] = (),
    ) -> int:
        """Acknowledge and delete ``ids``; the number acknowledged now. A ``fate`` (``trained``,
        ``filtered``) is archived for each, in the order given (a batch's order); ``tally`` (one
        ``sources`` field per id, or none) counts each acknowledged one."""
        if not ids:
            return 0
        # the ledger holds group ids only: for another stream, pass the stream itself (= none)
        sizes = self.keys.group_bytes if stream == self.keys.groups else stream
        acked = await self._run(
            ACK_DELETE, stream=stream, sizes=sizes, group=group, counter=counter,
            second_counter=second_counter, time_field=time_field, now_ms=now_ms, fate=fate, reason=reason,
            actor=actor, tally=json.dumps(list(tally)) if any(tally) else "", ids=ids,
        )
        return int(acked)

    async def eval_collect(self, name: str, result: str, actor: str, ids: Sequence[bytes | str], now_ms: int) -> int:
        """Archive and delete a finished eval's groups and store its result; the groups removed."""
        return int(await self._run(EVAL_COLLECT, name=name, result=result, actor=actor, now_ms=now_ms, ids=ids))

    async def archived(self, pairs: Sequence[tuple[bytes | str, int]], cursor: str, now_ms: int) -> int:
        """Confirm archive records written to files: deleted from the stream and the ledger; the
        number still there."""
        flat: list[Any] = []
        for record_id, size in pairs:
            flat.extend((record_id, size))
        return int(await self._run(ARCHIVED, cursor=cursor, now_ms=now_ms, pairs=flat))

    async def admit(self, *, consumer: str, config: PipelineConfig, count: int = 1, now_ms: int = 0) -> AdmitReply:
        """Run ADMIT under the namespace's ``config`` (its backlog caps and admission rule): up to
        ``count`` prompts (retry stream first), or why none."""
        result = await self._run(
            ADMIT, consumer=consumer, max_backlog=config.max_backlog,
            admission=1 if config.admission_enabled else 0, max_staleness=config.max_staleness or 0,
            batch_size=config.batch_size, steps_per_version=config.steps_per_version, count=max(1, count),
            now_ms=now_ms, max_backlog_bytes=config.max_backlog_bytes,
        )
        status = result[0].decode() if isinstance(result[0], bytes) else str(result[0])
        if status != "ok":
            return AdmitReply(status, None, [], [int(x) for x in result[1:]])
        streams = (self.keys.retry, self.keys.prompts, self.keys.eval_prompts)
        entries = []
        for i in range(2, len(result), 3):
            flat = result[i + 2] or []
            entries.append((streams[int(result[i]) - 1], result[i + 1], dict(zip(flat[::2], flat[1::2], strict=True))))
        return AdmitReply(status, int(result[1]), entries, [])

    async def forget_group(self, entry_id: str | bytes) -> int:
        """Acknowledge a delivered group entry that is gone from the stream and drop it from the
        byte ledger; the bytes it held."""
        return int(await self._run(FORGET, entry_id=entry_id))

    async def requeue(self, dead_id: str | bytes, prompt_fields: Mapping[str, Any]) -> bytes | None:
        """Move a dead-letter entry back to the retry stream; None when it was already gone."""
        result = await self._run(
            REQUEUE, dead_id=dead_id, counter=StateField.REQUEUED, tally=_tally(prompt_fields, "requeued"),
            fields=_flatten(prompt_fields),
        )
        return result or None

    async def row_stats(self, k: int, items: Sequence[tuple[str, float, float, int, int]]) -> int:
        """Record finished groups in their rows' statistics: (field, mean reward, reward variance,
        version, epoch) each, the last ``k`` kept."""
        if not items:
            return 0
        return int(await self._run(ROW_STATS, k=k, items=[v for item in items for v in item]))

    async def renew(self, stream: str, consumer: str, ids: Iterable[str | bytes]) -> list[bytes]:
        ids = list(ids)
        if not ids:
            return []
        return list(await self._run(RENEW, stream=stream, consumer=consumer, ids=ids))

    async def reclaim_turn(self, now_ms: int, interval_ms: int) -> tuple[bool, int]:
        """(whether this call took the fleet's reclaim turn, when idle prompts were last found)."""
        won, due = await self._run(RECLAIM_TURN, now_ms=now_ms, interval_ms=interval_ms)
        return bool(won), int(due)

    async def set_version(self, *, version: int | None, paused: bool | None, message: str) -> None:
        """Set the weight version (recording the consumption terms when it changes) and/or the
        paused flag, and announce ``message`` on the control channel, atomically."""
        await self._run(
            SET_VERSION, version="" if version is None else version,
            paused="" if paused is None else (1 if paused else 0), channel=self.keys.control, message=message,
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
        dead: Sequence[Mapping[str, Any]] = (),
        sources: Sequence[tuple[str, str, Any]] = (),
    ) -> int | None:
        """Add prompt entries (and dead letters for rows that cannot be fed) and move the cursor;
        None when the cursor moved meanwhile."""
        width = 2 * len(entries[0]) if entries else 0
        flat: list[Any] = []
        for fields in entries:
            if 2 * len(fields) != width:
                raise ValueError("every fed entry must have the same fields")
            flat.extend(_flatten(fields))
        result = await self._run(
            FEED, expected_next=expected_next, next_after=next_after, epoch=epoch, position=position,
            dataset=dataset, rejected=json.dumps([[str(v) for v in _flatten(d)] for d in dead]),
            updates=json.dumps([str(v) for update in sources for v in update]), width=width or 2, entries=flat,
        )
        return None if result is None else int(result)

    async def journal_append(
        self, *, source: str, consumer: str, entry_id: str | bytes, journal: str, member: int, seq: int,
        budget: int, step: bytes,
    ) -> str:
        """Append one episode step under the lease: 'ok', 'lost' (not ours) or 'full' (budget)."""
        result = await self._run(
            JOURNAL_APPEND, source=source, journal=journal, consumer=consumer, entry_id=entry_id,
            member=member, seq=seq, budget=budget, step=step,
        )
        return result.decode() if isinstance(result, bytes) else str(result)

    async def limit_acquire(
        self, *, name: str, token: str, lease_ms: int, size_hint: int, waited_ms: int
    ) -> tuple[str, int]:
        """One unit of a namespace limit: ('ok' | 'wait' | 'unknown', the limit's size)."""
        k = self.keys
        status, size = await self._run(
            LIMIT_ACQUIRE, holders=k.limit_holders(name), waiters=k.limit_waiters(name), name=name, token=token,
            lease_ms=lease_ms, size_hint=size_hint, waited_ms=waited_ms,
        )
        return (status.decode() if isinstance(status, bytes) else str(status)), int(size)

    async def limit_renew(self, name: str, tokens: Sequence[str], lease_ms: int) -> list[str]:
        """Extend the leases of ``tokens``' units; the tokens that lost theirs."""
        if not tokens:
            return []
        lost = await self._run(LIMIT_RENEW, holders=self.keys.limit_holders(name), lease_ms=lease_ms, tokens=tokens)
        return [t.decode() if isinstance(t, bytes) else str(t) for t in lost]

    async def rate_take(self, *, name: str, rate_hint: float, waited_ms: int) -> tuple[str, int]:
        """One token of a namespace rate: ('ok', 0), ('wait', ms until one is due) or ('unknown', 0)."""
        status, wait_ms = await self._run(
            RATE_TAKE, bucket=self.keys.rate_bucket(name), name=name, rate_hint=repr(float(rate_hint)),
            waited_ms=waited_ms,
        )
        return (status.decode() if isinstance(status, bytes) else str(status)), int(wait_ms)

    async def lease(self, key: str, token: str, ttl_ms: int) -> bool:
        """Take the lease ``key`` if free, or renew it if ``token`` holds it; False when another does."""
        return bool(await self._run(LEASE, lease=key, token=token, ttl_ms=ttl_ms))

    async def release(self, key: str, token: str) -> bool:
        """Delete the lease ``key`` if ``token`` still holds it."""
        return bool(await self._run(RELEASE, lease=key, token=token))
