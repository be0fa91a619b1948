-- Deletes the lease only if we still hold it.
-- KEYS: lease
-- ARGV: token
if redis.call('GET', lease) == token then return redis.call('DEL', lease) end
return 0
