-- A delivered group found gone
-- from the stream (XTRIM, XDEL): acknowledged, and out of the byte ledger.
-- KEYS: groups state group_bytes
-- ARGV: group entry_id
if redis.call('XACK', groups, group, entry_id) == 0 then group_exists(groups, group) end
return forget(group_bytes, state, entry_id)
