-- The payload plane's orphan sweep (issue 48): intents past their deadline are objects a producer
-- put and never published (it died between the put and PUBLISH, or gave up); up to ``count`` of
-- them move to ``payload_free`` (deleted from the store by the caller) and are counted. An intent
-- PUBLISH turned into a claim meanwhile is no longer in ``payload_intents``: nothing published is
-- ever swept.
-- KEYS: payload_intents payload_free state
-- ARGV: now_ms count
local due = redis.call('ZRANGEBYSCORE', payload_intents, '-inf', now_ms, 'LIMIT', 0, tonumber(count))
for _, key in ipairs(due) do
  redis.call('ZREM', payload_intents, key)
  redis.call('ZADD', payload_free, now_ms, key)
end
if #due > 0 then incr(state, '$PAYLOAD_SWEPT', #due) end
return due
