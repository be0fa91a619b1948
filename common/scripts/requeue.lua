-- The dead stream has no consumer group, so XDEL's reply is the ownership check: only the call
-- that deleted the entry re-adds it, and a re-sent or concurrent requeue adds nothing.
-- A dead letter's payload objects (``refs``: an undecodable group kept as it came) that the
-- requeued entry does not refer to are released.
-- KEYS: dead retry state sources payload_held payload_free
-- ARGV: dead_id counter tally *fields
local rows = redis.call('XRANGE', dead, dead_id, dead_id)
if redis.call('XDEL', dead, dead_id) == 0 then
  return false
end
local kept = ''
for i = fields_at, #ARGV - 1, 2 do if ARGV[i] == 'refs' then kept = ARGV[i + 1] end end
release(refs_of(rows[1][2]), kept, payload_held, payload_free, state, 0)
local id = redis.call('XADD', retry, '*', unpack(ARGV, fields_at))
incr(state, counter, 1)
if tally ~= '' then incr(sources, tally, 1) end
return id
