-- A group published and its prompt (an entry of ``source``: prompts or retry) acknowledged; the
-- group's size goes into the byte ledger in the same step as the group, and the prompt's episode
-- journal (``journal``, durable episodes; ``drop`` '1') is deleted in it too. ``objects``
-- ('member:bytes', '' = none) is the group's payload object set (one ledger member whatever its
-- sample count, ``_helpers.lua``), put before this script: its intent becomes a claim
-- (``payload_held``) and the entry's id -> member goes into ``payload_refs`` (the fate scripts
-- find it there, without reading the entry); a duplicate frees it instead (queued in
-- ``payload_free``: nothing will ever refer to it). The prompt's own objects (``prompt_refs``, its
-- entry's ``refs`` field as the producer read it, '' = none: partial samples of a recycled group,
-- partial rollout) are released with it (the group carries the arrays it continued in objects of
-- its own); passed in rather than read back, so a publish costs no XRANGE of the prompt.
-- KEYS: source groups state group_bytes journal sources payload_intents payload_held payload_free payload_refs
-- ``eval_bytes``: a group of the eval lane's size, into its own ledger (``$EVAL_BYTES``), not the training one.
-- ARGV: group prompt_id now_ms data_bytes drop tally objects eval_bytes prompt_refs *fields
local claimed = redis.call('XACK', source, group, prompt_id) == 1
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
  incr(state, '$DUPLICATES', 1)
  return false
end
release(prompt_refs, '', payload_held, payload_free, state, now_ms)
redis.call('XDEL', source, prompt_id)
if drop == '1' then drop_journal(journal, state, payload_held, payload_free) end
local id = redis.call('XADD', groups, '*', unpack(ARGV, fields_at))
incr(state, '$PUBLISHED', 1)
if tally ~= '' then
  incr(sources, tally, 1)
  move_held(sources, tally, 'backlog', 1)
  move_held(sources, tally, 'flight', -1)
end
local e = tonumber(eval_bytes) or 0
if e > 0 then incr(state, '$EVAL_BYTES', e) end
local b = tonumber(data_bytes) or 0
if b > 0 then
  for member in string.gmatch(objects, '(%S+):%d+') do redis.call('HSET', payload_refs, id, member) end
  redis.call('HSET', group_bytes, id, b)
  incr(state, '$GROUP_BYTES', b)
  incr(state, '$PUBLISHED_BYTES', b)
end
redis.call('HSET', state, '$LAST_PUBLISH_MS', now_ms)
return id
