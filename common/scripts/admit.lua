-- ``admission``: 1/0; S = ``max_staleness``, B = ``batch_size``, K = ``steps_per_version``,
-- cap = ``cadence_cap``. Returns {reason, ...} or {'ok', weight version, (stream index, id, fields)...}: reads up to
-- ``count`` prompts, retry stream first (stream index 1) then prompts (2), and counts them as
-- admitted, only when the pipeline is not paused, the READY backlog (XLEN groups - pending in
-- groups) is under its cap and (with admission control) outstanding < capacity, where
--   outstanding = pending(retry) + pending(prompts) + ready
--   c = max(0, committed + pending(groups) - version_start_consumed)
--   G = max(K * B, min(prev_version_consumed, cap * K * B))
--   capacity = max(1, (S + 1) * G - min(c, G))
-- (the same arithmetic as common/admission.py); then reads at most capacity - outstanding, and
-- at most max_backlog - ready (a burst never overshoots the backlog cap by more than one read).
-- With a byte budget (``max_backlog_bytes`` > 0) and groups ready, the bytes held in the group stream plus the
-- prompts in flight at the mean group size must stay under it:
--   projected = group_bytes + (pending(retry) + pending(prompts)) * mean, mean = published_bytes / published
-- and one more group of the mean size must fit (projected + mean <= budget); at most
-- (budget - projected) / mean are read. With no group ready the budget does not
-- refuse: a trainer waiting inside take() for a batch larger than the budget must get it.
-- Refusals: {'paused'}, {'backlog', ready}, {'backlog_bytes', projected, budget},
-- {'staleness', outstanding, capacity, c, G}, {'empty'}.
-- KEYS: retry prompts groups state eval_prompts
-- ARGV: group consumer max_backlog admission max_staleness batch_size steps_per_version count trainer_group cadence_cap now_ms max_backlog_bytes
-- uses: pending
local st = redis.call('HMGET', state, '$PAUSED', '$WEIGHT_VERSION', '$COMMITTED',
  '$VERSION_START_CONSUMED', '$PREV_VERSION_CONSUMED', '$GROUP_BYTES', '$PUBLISHED_BYTES', '$PUBLISHED')
if st[1] == '1' then return {'paused'} end
-- The eval lane first (stream index 3): its groups never enter the group stream, so neither the
-- backlog, the byte budget nor the staleness rule holds it back; a round that admits eval
-- prompts admits nothing else. pcall: a namespace of an older version has no eval stream yet.
local ev = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', tonumber(count), 'STREAMS', eval_prompts, '>')
if type(ev) == 'table' and ev[1] and ev[1][2] and #ev[1][2] > 0 then
  local out = {'ok', tostring(math.max(0, num(st[2])))}
  for _, entry in ipairs(ev[1][2]) do
    table.insert(out, 3)
    table.insert(out, entry[1])
    table.insert(out, entry[2])
  end
  return out
end
local taken = pending(groups, trainer_group)
local ready = math.max(0, redis.call('XLEN', groups) - taken)
if ready >= tonumber(max_backlog) then return {'backlog', ready} end
local room = math.min(tonumber(count), tonumber(max_backlog) - ready)
local in_flight = pending(retry, group) + pending(prompts, group)
local budget = tonumber(max_backlog_bytes) or 0
if budget > 0 and ready > 0 then
  local mean = 0
  if num(st[8]) > 0 then mean = math.ceil(num(st[7]) / num(st[8])) end
  local projected = num(st[6]) + in_flight * mean
  if projected + math.max(mean, 1) > budget then return {'backlog_bytes', projected, budget} end
  if mean > 0 then room = math.min(room, math.floor((budget - projected) / mean)) end
end
if admission == '1' then
  local outstanding = in_flight + ready
  local c = math.max(0, num(st[3]) + taken - num(st[4]))
  local declared = tonumber(steps_per_version) * tonumber(batch_size)
  local g = math.max(declared, math.min(num(st[5]), tonumber(cadence_cap) * declared))
  local capacity = math.max(1, (tonumber(max_staleness) + 1) * g - math.min(c, g))
  if outstanding >= capacity then return {'staleness', outstanding, capacity, c, g} end
  room = math.min(room, capacity - outstanding)
end
local out = {'ok', tostring(math.max(0, num(st[2])))}
local got = 0
local lanes = {retry, prompts}
for i = 1, 2 do
  if got >= room then break end
  local res = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', room - got, 'STREAMS', lanes[i], '>')
  if res then
    for _, entry in ipairs(res[1][2]) do
      table.insert(out, i)
      table.insert(out, entry[1])
      table.insert(out, entry[2])
      got = got + 1
    end
  end
end
if got == 0 then return {'empty'} end
incr(state, '$ADMITTED', got)
redis.call('HSET', state, '$LAST_ADMIT_MS', now_ms)
return out
