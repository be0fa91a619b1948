-- ``stream``: prompts or retry. Renews the lease of each id still
-- owned by this consumer (XCLAIM JUSTID resets its idle time) and returns the ids it no longer
-- owns: never steals back an entry another producer has taken over.
-- KEYS: stream
-- ARGV: group consumer *ids
local lost = {}
for i = ids_at, #ARGV do
  local p = redis.call('XPENDING', stream, group, ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == consumer then
    redis.call('XCLAIM', stream, group, consumer, 0, ARGV[i], 'JUSTID')
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
