-- Extends the leases of ``tokens`` still holding a unit of one limit; returns the ones that lost
-- theirs (expired: the producer's loop or network stalled past the lease).
-- KEYS: holders
-- ARGV: lease_ms *tokens
-- uses: now
local lost = {}
for i = tokens_at, #ARGV do
  local score = redis.call('ZSCORE', holders, ARGV[i])
  if score and tonumber(score) > now then
    redis.call('ZADD', holders, now + tonumber(lease_ms), ARGV[i])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
