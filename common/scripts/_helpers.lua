-- Every script starts with these helpers: a value read back from Redis is parsed defensively
-- (``num``: not a number -> 0), and a counter holding garbage (``HSET state committed abc``) is
-- reset before HINCRBY, which would otherwise fail the whole hand-over.
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
-- The payload plane (issue 48). A group's objects are one ledger member (its object set, the
-- entry's plain field ``refs``: ``<base>-<n>`` names the keys ``<base>-<n>.0`` .. ``.<n-1>``, any
-- other member is one key; ``payload/refs.py``); ``held`` (hash member -> bytes) lists every set
-- some entry refers to, ``free`` (sorted set, score = when) the sets nothing refers to any more: a
-- later step deletes their keys from the store and removes a member only once every key of it is
-- confirmed gone. A group's claim, release and free are one command each, whatever its sample
-- count. ``refs_of``: an entry's flat fields' refs ('' = none). ``release``: each member of
-- ``refs`` (space-separated) that ``kept`` (the refs of the entry that replaces it, '' = none)
-- does not name leaves ``held`` for ``free``; the number released. An episode journal's steps
-- kept in the store are listed in its field ``objects`` the same way (one key each).
local function refs_of(f)
  for i = 1, #f - 1, 2 do if f[i] == 'refs' then return f[i + 1] end end
  return ''
end
local function release(refs, kept, held, free, state, when)
  if refs == '' then return 0 end
  local n = 0
  kept = ' ' .. kept .. ' '
  for key in string.gmatch(refs, '%S+') do
    if not string.find(kept, ' ' .. key .. ' ', 1, true) then
      local b = redis.call('HGET', held, key)
      if b then
        redis.call('HDEL', held, key)
        if incr(state, '$PAYLOAD_BYTES', -num(b)) < 0 then redis.call('HSET', state, '$PAYLOAD_BYTES', 0) end
      end
      redis.call('ZADD', free, tonumber(when) or 0, key)
      n = n + 1
    end
  end
  return n
end
-- The byte budget's ledger: the size of every group entry's data (hash ``sizes``) and their sum
-- in the state hash; ``forget`` removes one entry from both (never below zero).
local function forget(sizes, state, id)
  local b = num(redis.call('HGET', sizes, id))
  if b > 0 then
    redis.call('HDEL', sizes, id)
    if incr(state, '$GROUP_BYTES', -b) < 0 then redis.call('HSET', state, '$GROUP_BYTES', 0) end
  end
  return b
end
-- An episode journal (durable episodes) leaves with its prompt: its bytes leave the state hash's
-- ``journal_bytes`` in the same step. ``journal`` '' = the prompt has none to drop. True when
-- there was one.
-- Its steps kept in the payload store (field ``objects``: their keys) are released with it.
local function drop_journal(journal, state, held, free)
  if journal == '' then return false end
  local j = redis.call('HMGET', journal, 'bytes', 'objects')
  if redis.call('DEL', journal) == 0 then return false end
  local b = num(j[1])
  if b > 0 and incr(state, '$JOURNAL_BYTES', -b) < 0 then redis.call('HSET', state, '$JOURNAL_BYTES', 0) end
  if j[2] then release(j[2], '', held, free, state, 0) end
  return true
end
-- A kept journal's pointer (fields ``stream`` and ``entry_id``: where its prompt's entry is, for
-- the orphan sweep's lookup) follows its prompt to the new entry ``to_id`` of ``to_stream``, in the
-- script that moves the prompt; only when it named the entry that moved (``journal`` = ``state``:
-- the caller names none).
local function follow_journal(journal, state, from_stream, from_id, to_stream, to_id)
  if journal == state then return end
  local at = redis.call('HMGET', journal, 'stream', 'entry_id')
  if at[1] == from_stream and at[2] == from_id then
    redis.call('HSET', journal, 'stream', to_stream, 'entry_id', to_id)
  end
end
-- A named source's groups in the group stream (``<name>:backlog``) or prompts in flight
-- (``<name>:flight``) in the ``sources`` hash, read by ADMIT's per-source cap, move by ``delta``
-- (never below zero); ``tally`` is any ``<name>:<kind>`` counter of the entry's source ('' = an
-- unnamed source: nothing to count).
local function move_held(sources, tally, what, delta)
  if tally == '' then return end
  local name = string.match(tally, '^(.*):[^:]*$')
  if name and incr(sources, name .. ':' .. what, delta) < 0 then redis.call('HSET', sources, name .. ':' .. what, 0) end
end
-- The ledger member a listed store key belongs to (``payload/refs.py``'s ``member_of``).
local function member_of(key)
  local base, index = string.match(key, '^(.*%-%d+)%.(%d+)$')
  if base and tonumber(index) < tonumber(string.match(base, '%-(%d+)$')) then return base end
  return key
end
-- The refs of entry ``id`` of ``stream`` ('' when it has none, or is gone), taken out of
-- ``payload_refs`` (written by PUBLISH) for an entry of the group stream (``grouped``): no read of
-- the entry's fields; read from the entry itself (XRANGE) for another stream, only while the
-- namespace has a payload store (``config``'s ``payload_store``): other namespaces pay nothing.
local function entry_refs(config, stream, id, grouped, refs_key)
  if grouped then
    local refs = redis.call('HGET', refs_key, id)
    if not refs then return '' end
    redis.call('HDEL', refs_key, id)
    return refs
  end
  local store = redis.call('HGET', config, 'payload_store')
  if not store or store == '' then return '' end
  local rows = redis.call('XRANGE', stream, id, id)
  if #rows == 0 then return '' end
  return refs_of(rows[1][2])
end
