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
-- With a mix, ``source_caps`` is JSON {name: cap} (each source's share of max_backlog, rounded up,
-- at least 1): a prompt of a source whose groups held (``<name>:backlog`` in the group stream +
-- ``<name>:flight`` admitted, not finished) reach its cap is not admitted while another source
-- still has prompts coming (queued: fed + requeued - lost - committed - backlog - flight > 0, in
-- flight, or its feeder not ``done``). Entries are
-- peeked after the lane's last delivered id; only an admissible run is read, refused ones before
-- it are parked at the end of the retry stream. A lone source with prompts left is never held
-- back, and with nothing in flight, nothing taken and nothing admissible the caps do not refuse
-- (no deadlock; counted in ``source_cap_bypassed``). A cap is never below the source's quota of a
-- batch plus one (the carry), so a take can always get its quota within the caps.
-- Refusals: {'paused'}, {'backlog', ready}, {'backlog_bytes', projected, budget},
-- {'staleness', outstanding, capacity, c, G}, {'source_backlog', backlog, cap}, {'empty'}.
-- KEYS: retry prompts groups state eval_prompts sources eval_groups
-- ARGV: group consumer max_backlog admission max_staleness batch_size steps_per_version count trainer_group cadence_cap now_ms max_backlog_bytes source_caps
-- uses: pending
local st = redis.call('HMGET', state, '$PAUSED', '$WEIGHT_VERSION', '$COMMITTED',
  '$VERSION_START_CONSUMED', '$PREV_VERSION_CONSUMED', '$GROUP_BYTES', '$PUBLISHED_BYTES', '$PUBLISHED')
if st[1] == '1' then return {'paused'} end
-- The eval lane first (stream index 3): its groups never enter the group stream, so the training
-- backlog, byte budget and staleness rule do not hold it back; it has bounds of its own, the same
-- numbers: its groups not yet collected by ``eval_results`` (XLEN eval_groups) plus its prompts in
-- flight stay under ``max_backlog``, and with a byte budget and eval groups held, their bytes
-- (``$EVAL_BYTES``) plus the prompts in flight at their mean size, plus one more, fit in it. A
-- round that admits eval prompts admits nothing else; an eval lane at its bound lets training
-- prompts in. pcall: a namespace of an older version has no eval stream yet.
local eval_ready = redis.pcall('XLEN', eval_groups)
if type(eval_ready) ~= 'number' then eval_ready = 0 end
local eval_flight = pending(eval_prompts, group)
local eval_room = math.min(tonumber(count), tonumber(max_backlog) - eval_ready - eval_flight)
local eval_budget = tonumber(max_backlog_bytes) or 0
if eval_room > 0 and eval_budget > 0 and eval_ready > 0 then
  local held = math.max(0, num(redis.call('HGET', state, '$EVAL_BYTES')))
  local mean = math.max(1, math.ceil(held / eval_ready))
  local projected = held + eval_flight * mean
  eval_room = math.min(eval_room, math.floor((eval_budget - projected) / mean))
  if projected + mean > eval_budget then eval_room = 0 end
end
local ev = nil
if eval_room > 0 then
  ev = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', eval_room, 'STREAMS', eval_prompts, '>')
end
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
-- the per-source cap: each source's groups held (in the group stream + prompts in flight), and
-- whether another source still has prompts coming (queued, in flight, or its feeder not done)
local caps, held, others_behind = {}, {}, {}
if source_caps ~= '' then
  caps = cjson.decode(source_caps)
  local behind = {}
  for name, cap in pairs(caps) do
    local v = redis.call('HMGET', sources, name .. ':backlog', name .. ':flight', name .. ':fed',
      name .. ':requeued', name .. ':lost', name .. ':committed', name .. ':done')
    local b, f = math.max(0, num(v[1])), math.max(0, num(v[2]))
    held[name] = b + f
    if v[7] ~= '1' or f > 0 or num(v[3]) + num(v[4]) - num(v[5]) - num(v[6]) - b - f > 0 then
      behind[name] = true
    end
  end
  for name in pairs(caps) do
    for other in pairs(behind) do
      if other ~= name then others_behind[name] = true end
    end
  end
end
local function source_of(fields)
  for j = 1, #fields - 1, 2 do
    if fields[j] == 'source' then return fields[j + 1] end
  end
  return nil
end
local refused = nil
local function over(source)
  if source and others_behind[source] and held[source] >= caps[source] then
    refused = {held[source], caps[source]}
    return true
  end
  return false
end
-- the entries of ``lane`` that XREADGROUP '>' would deliver next (up to ``n``)
local function peek(lane, n)
  for _, g in ipairs(redis.call('XINFO', 'GROUPS', lane)) do
    local row = {}
    for j = 1, #g - 1, 2 do row[g[j]] = g[j + 1] end
    if row['name'] == group then return redis.call('XRANGE', lane, '(' .. row['last-delivered-id'], '+', 'COUNT', n) end
  end
  return {}
end
-- How many of the lane's next entries may be read. A prompt lane whose head is refused parks the
-- refused entries before the first admissible one (within PARK_SCAN) at the end of the retry
-- stream (XDEL + XADD, never delivered: nothing lost or doubled), so a behind source's prompts
-- queued behind them move.
local PARK_SCAN = 64
local function admissible(i, lane, want)
  if next(others_behind) == nil then return want end
  local entries = peek(lane, math.max(want, PARK_SCAN))
  local first = nil
  for j, entry in ipairs(entries) do
    if not over(source_of(entry[2])) then
      first = j
      break
    end
  end
  if not first then return 0 end
  if first > 1 and i == 2 then
    for j = 1, first - 1 do
      redis.call('XDEL', lane, entries[j][1])
      redis.call('XADD', retry, '*', unpack(entries[j][2]))
    end
    incr(state, '$PARKED', first - 1)
  elseif first > 1 then
    return 0
  end
  local n = 0
  for j = first, #entries do
    if n >= want then break end
    local source = source_of(entries[j][2])
    if over(source) then break end
    if source and held[source] then held[source] = held[source] + 1 end
    n = n + 1
  end
  return n
end
local out = {'ok', tostring(math.max(0, num(st[2])))}
local got = 0
local lanes = {retry, prompts}
local function read(ignore_caps)
  for i = 1, 2 do
    if got >= room then break end
    local want = room - got
    if not ignore_caps then want = admissible(i, lanes[i], want) end
    if want > 0 then
      local res = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', want, 'STREAMS', lanes[i], '>')
      if res then
        for _, entry in ipairs(res[1][2]) do
          table.insert(out, i)
          table.insert(out, entry[1])
          table.insert(out, entry[2])
          local source = source_of(entry[2])
          if source and caps[source] then incr(sources, source .. ':flight', 1) end
          got = got + 1
        end
      end
    end
  end
end
read(false)
-- nothing admissible, nothing in flight and nothing taken by the trainer (whose commit would free
-- room): the caps would only stall the pipeline, so read as if there were none
if got == 0 and refused and in_flight == 0 and taken == 0 then
  read(true)
  incr(state, '$CAP_BYPASSED', got)
end
if got == 0 and refused then return {'source_backlog', refused[1], refused[2]} end
if got == 0 then return {'empty'} end
incr(state, '$ADMITTED', got)
redis.call('HSET', state, '$LAST_ADMIT_MS', now_ms)
return out
