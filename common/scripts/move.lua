-- ``ledger``: '' = neither stream is the group stream, 's' = the source is, 'st' = both are.
-- Acknowledges and deletes an entry of the source stream and adds a new entry to the target
-- stream: a prompt recycled (groups -> retry), returned (prompts/retry -> retry), dead-lettered
-- (any -> dead) or a group released (groups -> groups); a group leaving the stream leaves the
-- byte ledger with it. ``fate`` ('recycled', 'dead_lettered' or '' = none) is archived first
-- (``_archive.lua``), by ``actor`` from the ``kind`` of stream it left. ``drop`` '1': the prompt's
-- episode journal (``journal``) is deleted in the same step (a dead letter); a returned prompt
-- keeps it for the producer that takes it over, and its pointer follows it to the new entry.
-- The entry's payload objects (``refs``) that the new entry does not refer to are released
-- (``_helpers.lua``), unless its archive record now refers to them; a group's are found in
-- ``payload_refs`` (the entry's data is never read back), and follow it to its new entry when it
-- stays in the group stream. Those the new entry names (its ``refs``: a recycled group's retry
-- prompt keeping its partial samples' objects, a prompt returned or dead-lettered) stay held,
-- by the new entry alone (its archive record is written without them).
-- ``objects`` ('member:bytes', '' = none): objects the new entry refers to that a producer put just
-- before (a dead letter's partial samples generated there): their intent becomes a claim, as in
-- PUBLISH; when the XACK finds the entry already handed over they are queued to be freed instead.
-- KEYS: source target state group_bytes config archive journal sources payload_held payload_free payload_refs payload_intents
-- ARGV: group entry_id counter ledger fate reason actor kind now_ms drop tally objects *fields
-- uses: archive
local claimed = redis.call('XACK', source, group, entry_id) == 1
for key, size in string.gmatch(objects, '(%S+):(%d+)') do
  redis.call('ZREM', payload_intents, key)
  if claimed then
    redis.call('HSET', payload_held, key, size)
    incr(state, '$PAYLOAD_BYTES', tonumber(size))
  else
    redis.call('ZADD', payload_free, now_ms, key)
  end
end
if not claimed then
  group_exists(source, group)
  return false
end
local refs = entry_refs(config, source, entry_id, ledger ~= '', payload_refs)
local kept = ''
if refs ~= '' then
  for i = fields_at, #ARGV - 1, 2 do if ARGV[i] == 'refs' then kept = ARGV[i + 1] end end
end
local archived = false
if fate ~= '' then
  archived = archive_fate(config, archive, state, source, entry_id,
    {fate, reason, actor, '', '', kind, now_ms}, payload_held, payload_free, kept)
end
if refs ~= '' and not archived then release(refs, kept, payload_held, payload_free, state, now_ms) end
redis.call('XDEL', source, entry_id)
if drop == '1' then drop_journal(journal, state, payload_held, payload_free) end
local b = 0
if ledger ~= '' then b = forget(group_bytes, state, entry_id) end
local id = redis.call('XADD', target, '*', unpack(ARGV, fields_at))
if drop ~= '1' then follow_journal(journal, state, source, entry_id, target, id) end
if ledger == 'st' and kept ~= '' then redis.call('HSET', payload_refs, id, kept) end
if ledger == 'st' and b > 0 then
  redis.call('HSET', group_bytes, id, b)
  incr(state, '$GROUP_BYTES', b)
end
incr(state, counter, 1)
if tally ~= '' then
  incr(sources, tally, 1)
  if ledger == 's' then move_held(sources, tally, 'backlog', -1) end
  if kind ~= 'groups' then move_held(sources, tally, 'flight', -1) end
end
return id
