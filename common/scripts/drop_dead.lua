-- Dead letters deleted for good (``rollstream dead drop``); each one's payload objects (``refs``:
-- an undecodable group kept as it came) are released with it. The number that existed.
-- KEYS: dead state payload_held payload_free
-- ARGV: now_ms *ids
local gone = 0
for i = ids_at, #ARGV do
  local rows = redis.call('XRANGE', dead, ARGV[i], ARGV[i])
  if #rows > 0 then
    release(refs_of(rows[1][2]), '', payload_held, payload_free, state, now_ms)
    gone = gone + redis.call('XDEL', dead, ARGV[i])
  end
end
return gone
