-- Namespace-wide limits and rates use Redis' own clock (TIME), so producers on hosts whose clocks
-- differ share one. Redis 6.2 needs effects replication for a write after TIME (7+ always does it).
pcall(function() redis.replicate_commands() end)
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
