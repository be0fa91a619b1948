-- ``second_counter`` and ``time_field`` may be ''. Acknowledges and deletes entries (commit, filtered drop);
-- counts the acknowledged ones only, and takes those out of the byte ledger (an id the ledger
-- does not hold, e.g. a prompt's, changes nothing). ``fate`` ('trained', 'filtered' or '' = none)
-- is archived for each acknowledged group first (``_archive.lua``); a commit that acknowledged any is
-- one more trained step (``trained_steps``: the records' ``step``, ``position`` = order in it).
-- An acknowledged entry's payload objects (``refs``) are released, unless its archive record now
-- refers to them; a group's are found in ``payload_refs`` (the entry's data is never read back).
-- KEYS: stream state sizes config archive sources payload_held payload_free payload_refs
-- ARGV: group counter second_counter time_field now_ms fate reason actor tally *ids
-- uses: archive
local acked = 0
local step = ''
local tallies = {}
if tally ~= '' then tallies = cjson.decode(tally) end
if fate == 'trained' then step = tostring(num(redis.call('HGET', state, '$TRAINED_STEPS')) + 1) end
for i = ids_at, #ARGV do
  if redis.call('XACK', stream, group, ARGV[i]) == 1 then
    acked = acked + 1
    local field = tallies[i - ids_at + 1]
    if field and field ~= '' then
      incr(sources, field, 1)
      if sizes ~= stream then move_held(sources, field, 'backlog', -1) end
    end
    local refs = entry_refs(config, stream, ARGV[i], sizes ~= stream, payload_refs)
    local archived = false
    if fate ~= '' then
      local position = ''
      if step ~= '' then position = tostring(i - ids_at) end
      archived = archive_fate(config, archive, state, stream, ARGV[i],
        {fate, reason, actor, step, position, 'groups', now_ms}, payload_held, payload_free)
    end
    if not archived then release(refs, '', payload_held, payload_free, state, now_ms) end
    redis.call('XDEL', stream, ARGV[i])
    if sizes ~= stream then forget(sizes, state, ARGV[i]) end
  end
end
if acked == 0 then group_exists(stream, group) end
if acked > 0 then
  incr(state, counter, acked)
  if second_counter ~= '' then incr(state, second_counter, acked) end
  if step ~= '' then redis.call('HSET', state, '$TRAINED_STEPS', step) end
end
if time_field ~= '' then redis.call('HSET', state, time_field, now_ms) end
return acked
