-- The fleet's reclaim turn: the first producer to call it
-- an interval after the last turn takes it (returns 1) and looks for idle prompts; every call
-- also returns when idle prompts were last found (reclaim_due_ms), so the others take them over.
-- A turn stamped far in the future (a producer's clock ahead) is taken over too.
-- KEYS: state
-- ARGV: now_ms interval_ms
local st = redis.call('HMGET', state, '$RECLAIM_TURN_MS', '$RECLAIM_DUE_MS')
local now, interval, last = tonumber(now_ms), tonumber(interval_ms), num(st[1])
local won = 0
if now - last >= interval or last - now > interval then
  redis.call('HSET', state, '$RECLAIM_TURN_MS', now_ms)
  won = 1
end
return {won, num(st[2])}
