-- One finished step of an episode (durable episodes), appended to its prompt's journal only while
-- ``consumer`` holds the prompt attempt's lease (the entry ``entry_id`` of ``source`` is pending
-- under its name): a producer whose prompt was taken over writes nothing. Step ``seq`` of
-- ``member`` replaces that member's steps from ``seq`` on (a replay that diverged drops the rest;
-- a re-sent append rewrites the same step). ``budget`` > 0: the bytes of the groups held plus the
-- journals may not pass it, else nothing is written ('full'). The journal records where its
-- prompt's entry is (``stream``, ``entry_id``: the entry held), so the orphan sweep checks that one
-- entry instead of reading the prompt streams. Returns 'ok', 'lost' or 'full'.
-- KEYS: source journal state
-- ARGV: group consumer entry_id member seq budget step
local p = redis.call('XPENDING', source, group, entry_id, entry_id, 1)
if not p[1] or p[1][2] ~= consumer then return 'lost' end
local m, from = member, tonumber(seq)
local count = num(redis.call('HGET', journal, 'n:' .. m))
local freed = 0
for s = from, count - 1 do
  local f = m .. ':' .. s
  freed = freed + redis.call('HSTRLEN', journal, f)
  redis.call('HDEL', journal, f)
end
local size = string.len(step)
local limit = tonumber(budget) or 0
local st = redis.call('HMGET', state, '$GROUP_BYTES', '$JOURNAL_BYTES')
local status = 'ok'
if limit > 0 and num(st[1]) + num(st[2]) - freed + size > limit then
  size = 0
  status = 'full'
  if from < count then redis.call('HSET', journal, 'n:' .. m, from) end
else
  redis.call('HSET', journal, m .. ':' .. from, step, 'n:' .. m, from + 1)
  incr(state, '$JOURNAL_STEPS', 1)
end
if size - freed ~= 0 then
  redis.call('HINCRBY', journal, 'bytes', size - freed)
  if incr(state, '$JOURNAL_BYTES', size - freed) < 0 then redis.call('HSET', state, '$JOURNAL_BYTES', 0) end
end
if status == 'ok' or from < count then redis.call('HSET', journal, 'stream', source, 'entry_id', entry_id) end
return status
