-- One unit of the namespace limit ``name`` for ``token`` (a producer's episode), leased until
-- now + ``lease_ms``: expired holders (a killed producer's) are dropped first, so their units come
-- back within the lease. The limit's size is the ``limits`` hash's, else ``size_hint`` (the size
-- the producer last read: a Redis that restarted without the hash does not block anyone); 0 =
-- unknown. Granted: the wait (``waited_ms``) and the most holders at once go to ``limit_stats``.
-- Refused: the token is listed as a waiter (leased as well). A limit removed (``removed:NAME``
-- in the hash, no size) is no longer applied, whatever the hint: {'removed', 0}.
-- Returns {'ok'|'wait'|'unknown'|'removed', size}.
-- KEYS: limits holders waiters limit_stats
-- ARGV: name token lease_ms size_hint waited_ms
-- uses: now
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now)
local marks = redis.call('HMGET', limits, 'limit:' .. name, 'removed:' .. name)
local set = marks[1]
if not set and marks[2] then
  redis.call('ZREM', waiters, token)
  return {'removed', 0}
end
local size = tonumber(set or '') or tonumber(size_hint) or 0
if size <= 0 then return {'unknown', 0} end
local expiry = now + tonumber(lease_ms)
if redis.call('ZSCORE', holders, token) then
  redis.call('ZADD', holders, expiry, token)
  return {'ok', size}
end
local held = redis.call('ZCARD', holders)
if held >= size then
  redis.call('ZADD', waiters, expiry, token)
  return {'wait', size}
end
redis.call('ZADD', holders, expiry, token)
redis.call('ZREM', waiters, token)
incr(limit_stats, 'acquired:' .. name, 1)
incr(limit_stats, 'wait_ms:' .. name, tonumber(waited_ms) or 0)
if held + 1 > num(redis.call('HGET', limit_stats, 'peak:' .. name)) then
  redis.call('HSET', limit_stats, 'peak:' .. name, held + 1)
end
return {'ok', size}
