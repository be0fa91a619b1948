-- One finished step of an episode (durable episodes), appended to its prompt's journal only while
-- ``consumer`` holds the prompt attempt's lease (the entry ``entry_id`` of ``source`` is pending
-- under its name): a producer whose prompt was taken over writes nothing. Step ``seq`` of
-- ``member`` replaces that member's steps from ``seq`` on (a replay that diverged drops the rest;
-- a re-sent append rewrites the same step). ``budget`` > 0: the bytes of the groups held plus the
-- journals may not pass it, else nothing is written ('full'). The journal records where its
-- prompt's entry is (``stream``, ``entry_id``: the entry held), so the orphan sweep checks that one
-- entry instead of reading the prompt streams. Returns 'ok', 'lost' or 'full'. With a payload
-- store a large step is an object (``objects``: 'key:bytes', put before this script) and the
-- journal keeps a reference ('\193key bytes crc32', a byte msgpack never starts with): written,
-- its intent becomes a claim and its key joins the journal's ``objects``; not written, or replaced
-- by a later step, the object is released (``release``); its bytes count with the journal's.
-- KEYS: source journal state payload_intents payload_held payload_free
-- ARGV: group consumer entry_id member seq budget objects step
local okey, osize = string.match(objects, '^(%S+):(%d+)$')
osize = tonumber(osize) or 0
local function unclaimed()
  if okey then
    redis.call('ZREM', payload_intents, okey)
    redis.call('ZADD', payload_free, 0, okey)
  end
end
local p = redis.call('XPENDING', source, group, entry_id, entry_id, 1)
if not p[1] or p[1][2] ~= consumer then
  unclaimed()
  return 'lost'
end
local m, from = member, tonumber(seq)
local count = num(redis.call('HGET', journal, 'n:' .. m))
local freed = 0
local dropped = {}
for s = from, count - 1 do
  local f = m .. ':' .. s
  local len = redis.call('HSTRLEN', journal, f)
  freed = freed + len
  if len > 0 and len < 256 then  -- short: maybe a reference to an object
    local key, bytes = string.match(redis.call('HGET', journal, f), '^\193(%S+) (%d+) ')
    if key then
      freed = freed + tonumber(bytes)
      release(key, '', payload_held, payload_free, state, 0)
      dropped[key] = true
    end
  end
  redis.call('HDEL', journal, f)
end
if next(dropped) then
  local keep = {}
  for key in string.gmatch(redis.call('HGET', journal, 'objects') or '', '%S+') do
    if not dropped[key] then keep[#keep + 1] = key end
  end
  redis.call('HSET', journal, 'objects', table.concat(keep, ' '))
end
local size = string.len(step) + osize
local limit = tonumber(budget) or 0
local st = redis.call('HMGET', state, '$GROUP_BYTES', '$JOURNAL_BYTES')
local status = 'ok'
if limit > 0 and num(st[1]) + num(st[2]) - freed + size > limit then
  size = 0
  status = 'full'
  unclaimed()
  if from < count then redis.call('HSET', journal, 'n:' .. m, from) end
else
  redis.call('HSET', journal, m .. ':' .. from, step, 'n:' .. m, from + 1)
  incr(state, '$JOURNAL_STEPS', 1)
  if okey then
    redis.call('ZREM', payload_intents, okey)
    redis.call('HSET', payload_held, okey, osize)
    incr(state, '$PAYLOAD_BYTES', osize)
    local listed = redis.call('HGET', journal, 'objects')
    redis.call('HSET', journal, 'objects', (listed and listed ~= '' and (listed .. ' ') or '') .. okey)
  end
end
if size - freed ~= 0 then
  redis.call('HINCRBY', journal, 'bytes', size - freed)
  if incr(state, '$JOURNAL_BYTES', size - freed) < 0 then redis.call('HSET', state, '$JOURNAL_BYTES', 0) end
end
if status == 'ok' or from < count then redis.call('HSET', journal, 'stream', source, 'entry_id', entry_id) end
return status
