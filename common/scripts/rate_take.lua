-- One token of the namespace rate ``name`` (tokens per second from the ``limits`` hash, else
-- ``rate_hint``; a burst of one second's worth, at least 1). Returns {'ok', 0}, {'wait', ms until a
-- token is due}, {'unknown', 0} or {'removed', 0} (``limits remove``: no longer applied, whatever
-- the hint); a token taken counts in ``limit_stats`` with the wait before it.
-- KEYS: limits bucket limit_stats
-- ARGV: name rate_hint waited_ms
-- uses: now
local marks = redis.call('HMGET', limits, 'rate:' .. name, 'removed:' .. name)
local set = marks[1]
if not set and marks[2] then return {'removed', 0} end
local rate = tonumber(set or '') or tonumber(rate_hint) or 0
if rate <= 0 then return {'unknown', 0} end
local burst = math.max(1, rate)
local b = redis.call('HMGET', bucket, 'tokens', 'ts_ms')
local tokens, ts = tonumber(b[1]), tonumber(b[2])
if tokens == nil or ts == nil then tokens, ts = burst, now end
tokens = math.min(burst, tokens + math.max(0, now - ts) * rate / 1000)
if tokens >= 1 then
  redis.call('HSET', bucket, 'tokens', tostring(tokens - 1), 'ts_ms', now)
  incr(limit_stats, 'taken:' .. name, 1)
  incr(limit_stats, 'rate_wait_ms:' .. name, tonumber(waited_ms) or 0)
  return {'ok', 0}
end
redis.call('HSET', bucket, 'tokens', tostring(tokens), 'ts_ms', now)
return {'wait', math.ceil((1 - tokens) * 1000 / rate)}
