-- Orphan episode journals (durable episodes) swept: a journal whose prompt ended some other way
-- than PUBLISH or MOVE (an operator's XDEL or dead-letter tooling, a Redis 6.2 XAUTOCLAIM of a
-- deleted entry) would stay forever. A journal is kept while its prompt's entry is in a prompt
-- stream (waiting or pending: a returned prompt waits in ``retry``); the others are deleted with
-- their bytes. A journal names that entry (``stream``, ``entry_id``: written by JOURNAL_APPEND
-- under the lease, moved by the MOVE that returns the prompt), so it is checked with one XRANGE of
-- that id, whatever the streams hold. No other script gives a journaled prompt a new entry in a
-- prompt stream: ADMIT parks only entries never delivered (no journal was written under them),
-- and a recycled or requeued prompt is a new attempt whose journal went with its publish or dead
-- letter. Two fallbacks read streams whole, once per call and only when needed: a journal whose
-- entry is gone is kept if ``retry`` or ``eval_prompts`` holds its ``index:epoch`` (where a MOVE
-- of an older version, which leaves the pointer behind, puts a returned prompt; a journal left
-- by a publish that did not delete it, then recycled, stays as before); a journal without a
-- pointer (an older version's), or whose pointer names another prompt, is kept if any prompt
-- stream holds its ``index:epoch``. The fed backlog (``prompts``) is read for those only.
-- Atomic, so a prompt moving between streams is never missed. ``journals`` are the key names a
-- SCAN found (the caller bounds them with COUNT). Returns how many went.
-- KEYS: prompts retry eval_prompts state
-- ARGV: *journals
if #ARGV < journals_at then return 0 end
local streams = {[prompts] = true, [retry] = true, [eval_prompts] = true}
local function field(f, name)
  for i = 1, #f - 1, 2 do
    if f[i] == name then return f[i + 1] end
  end
  return nil
end
-- true: its entry is there; false: gone; nil: no usable pointer
local function pointed(journal, at)
  local ptr = redis.call('HMGET', journal, 'stream', 'entry_id')
  if not (ptr[1] and ptr[2] and streams[ptr[1]]) then return nil end
  local rows = redis.pcall('XRANGE', ptr[1], ptr[2], ptr[2])
  if type(rows) ~= 'table' or rows.err then return nil end
  if not rows[1] then return false end
  local f = rows[1][2]
  local index, epoch = field(f, 'index'), field(f, 'epoch')
  if index and epoch and index .. ':' .. epoch == at then return true end
  return nil
end
-- the ``index:epoch`` of every entry of ``lanes``
local function held(lanes)
  local found = {}
  for _, stream in ipairs(lanes) do
    local from = '-'
    while true do
      local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', 1000)
      for _, entry in ipairs(entries) do
        local index, epoch = field(entry[2], 'index'), field(entry[2], 'epoch')
        if index and epoch then found[index .. ':' .. epoch] = true end
      end
      if #entries < 1000 then break end
      from = '(' .. entries[#entries][1]
    end
  end
  return found
end
local returned, queued = nil, nil
local function in_returned(at)
  if not returned then returned = held({retry, eval_prompts}) end
  return returned[at] == true
end
local function in_queued(at)
  if not queued then queued = held({prompts}) end
  return queued[at] == true
end
local swept = 0
for i = journals_at, #ARGV do
  local journal = ARGV[i]
  local at = string.match(journal, ':episode:(%d+:%d+)$')
  if at then
    local live = pointed(journal, at)
    if live == false then
      live = in_returned(at)
    elseif live == nil then
      live = in_returned(at) or in_queued(at)
    end
    if not live then
      local b = num(redis.call('HGET', journal, 'bytes'))
      if redis.call('DEL', journal) == 1 then
        swept = swept + 1
        if b > 0 and incr(state, '$JOURNAL_BYTES', -b) < 0 then redis.call('HSET', state, '$JOURNAL_BYTES', 0) end
      end
    end
  end
end
if swept > 0 then incr(state, '$JOURNALS_SWEPT', swept) end
return swept
