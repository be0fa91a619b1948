-- The dead stream has no consumer group, so XDEL's reply is the ownership check: only the call
-- that deleted the entry re-adds it, and a re-sent or concurrent requeue adds nothing.
-- KEYS: dead retry state sources
-- ARGV: dead_id counter tally *fields
if redis.call('XDEL', dead, dead_id) == 0 then
  return false
end
local id = redis.call('XADD', retry, '*', unpack(ARGV, fields_at))
incr(state, counter, 1)
if tally ~= '' then incr(sources, tally, 1) end
return id
