-- One unit of the namespace limit ``name`` for ``token`` (a producer's episode), leased until
-- now + ``lease_ms``: expired holders (a killed producer's) are dropped first, so their units come
-- back within the lease. The limit's size is the ``limits`` hash's, else ``size_hint`` (the size
-- the producer last read: a Redis that restarted without the hash does not block anyone); 0 =
-- unknown. A limit removed (``removed:NAME`` in the hash, no size) is no longer applied, whatever
-- the hint: {'removed', 0}.
-- Fair: free units go to the waiters in the order they started waiting (``queue``, scored by
-- now - ``waited_ms`` when first seen), never to whoever polls first; a token is granted only when
-- fewer waiters than free units are ahead of it. A waiter is listed in ``waiters`` until now +
-- ``wait_lease_ms`` (it polls far more often): one that stopped polling (a killed producer's)
-- leaves both sets then, and no longer holds the line.
-- Granted: the wait (``waited_ms``) and the most holders at once go to ``limit_stats``.
-- Returns {'ok'|'wait'|'unknown'|'removed', size}.
-- KEYS: limits holders waiters queue limit_stats
-- ARGV: name token lease_ms size_hint waited_ms wait_lease_ms
-- uses: now
redis.call('ZREMRANGEBYSCORE', holders, '-inf', now)
local lapsed = redis.call('ZRANGEBYSCORE', waiters, '-inf', now)
for _, gone in ipairs(lapsed) do
  redis.call('ZREM', queue, gone)
end
redis.call('ZREMRANGEBYSCORE', waiters, '-inf', now)
local marks = redis.call('HMGET', limits, 'limit:' .. name, 'removed:' .. name)
local set = marks[1]
if not set and marks[2] then
  redis.call('ZREM', waiters, token)
  redis.call('ZREM', queue, token)
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
redis.call('ZADD', waiters, now + (tonumber(wait_lease_ms) or tonumber(lease_ms)), token)
redis.call('ZADD', queue, 'NX', now - (tonumber(waited_ms) or 0), token)
if held >= size or redis.call('ZRANK', queue, token) >= size - held then
  return {'wait', size}
end
redis.call('ZADD', holders, expiry, token)
redis.call('ZREM', waiters, token)
redis.call('ZREM', queue, token)
incr(limit_stats, 'acquired:' .. name, 1)
incr(limit_stats, 'wait_ms:' .. name, tonumber(waited_ms) or 0)
if held + 1 > num(redis.call('HGET', limit_stats, 'peak:' .. name)) then
  redis.call('HSET', limit_stats, 'peak:' .. name, held + 1)
end
return {'ok', size}
