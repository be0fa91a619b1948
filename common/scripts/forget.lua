-- A delivered group found gone
-- from the stream (XTRIM, XDEL): acknowledged, and out of the byte ledger. Its payload object set
-- (``payload_refs``, written by PUBLISH) is released: no entry refers to it any more.
-- KEYS: groups state group_bytes payload_held payload_free payload_refs
-- ARGV: group entry_id now_ms
if redis.call('XACK', groups, group, entry_id) == 0 then group_exists(groups, group) end
local refs = redis.call('HGET', payload_refs, entry_id)
if refs then
  redis.call('HDEL', payload_refs, entry_id)
  release(refs, '', payload_held, payload_free, state, now_ms)
end
return forget(group_bytes, state, entry_id)
