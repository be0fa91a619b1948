-- The payload plane's full sweep: ``keys`` were listed in the store under the namespace's prefix;
-- each one whose member (its group's object set, ``member_of``) no ledger knows (not being put, not held by an entry, not already queued to free) is
-- an object whose entry went without a fate script (an XDEL by hand, a stream lost): it is queued
-- in ``payload_free`` and counted as an orphan swept. A key listed while its put was under way has
-- its intent already (written before the put), so nothing in use is ever taken.
-- KEYS: payload_intents payload_held payload_free state
-- ARGV: now_ms *keys
-- The number is of members (object sets) queued.
local n = 0
local seen = {}
for i = keys_at, #ARGV do
  local key = member_of(ARGV[i])
  if not seen[key] and not redis.call('ZSCORE', payload_intents, key) and redis.call('HEXISTS', payload_held, key) == 0
      and not redis.call('ZSCORE', payload_free, key) then
    redis.call('ZADD', payload_free, now_ms, key)
    n = n + 1
  end
  seen[key] = true
end
if n > 0 then incr(state, '$PAYLOAD_SWEPT', n) end
return n
