-- Takes a free lease or renews our own; 0 when another holds it.
-- A renewal is a PEXPIRE, which Redis allows at maxmemory (SET is refused there), so a trainer
-- keeps its name while Redis is out of memory.
-- KEYS: lease
-- ARGV: token ttl_ms
local holder = redis.call('GET', lease)
if holder and holder ~= token then return 0 end
if holder then redis.call('PEXPIRE', lease, ttl_ms) return 1 end
redis.call('SET', lease, token, 'PX', ttl_ms)
return 1
