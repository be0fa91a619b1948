-- ``width``: fields per entry (names and values), ``entries``: all entries' fields, ``rejected``: a
-- JSON list of dead letters (flat field lists) for rows that cannot be fed, ``updates``: a JSON
-- list of (op, field, value) for the ``sources`` hash (op 's': HSET, 'i': add), the named sources'
-- cursors and fed counts. The feeder's
-- XADD and its cursor move together, and only from the cursor it read: a re-sent or concurrent call adds nothing.
-- KEYS: prompts state dead sources
-- ARGV: expected_next next_after epoch position dataset rejected updates width *entries
local cur = redis.call('HGET', state, '$FEED_NEXT_INDEX') or '0'
if cur ~= expected_next then return false end
local letters = cjson.decode(rejected)
for _, fields in ipairs(letters) do
  redis.call('XADD', dead, '*', unpack(fields))
end
incr(state, '$DEAD', #letters)
local ops = cjson.decode(updates)
for i = 1, #ops, 3 do
  if ops[i] == 'i' then incr(sources, ops[i + 1], tonumber(ops[i + 2]))
  else redis.call('HSET', sources, ops[i + 1], ops[i + 2]) end
end
local n = tonumber(width)
local added = 0
for i = entries_at, #ARGV, n do
  redis.call('XADD', prompts, '*', unpack(ARGV, i, i + n - 1))
  added = added + 1
end
redis.call('HSET', state, '$FEED_NEXT_INDEX', next_after, '$FEED_EPOCH', epoch,
  '$FEED_POSITION', position, '$FEED_DATASET', dataset)
incr(state, '$FED', added)
return added
