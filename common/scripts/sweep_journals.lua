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
-- Atomic, so a prompt moving between streams is never missed. An eval-lane prompt's journal
-- (``episode:eval:<name>:<index>:<epoch>``: eval sets are numbered from 0 like the dataset) is
-- matched as ``eval:<name>:<index>:<epoch>`` against ``eval_prompts`` entries alone (their plain
-- ``eval`` field), a training prompt's as ``index:epoch`` against the other streams alone.
-- ``journals`` are the key names a SCAN found (the caller bounds them with COUNT). Returns how
-- many went.
-- KEYS: prompts retry eval_prompts state payload_held payload_free
-- ARGV: *journals
if #ARGV < journals_at then return 0 end
local streams = {[prompts] = true, [retry] = true, [eval_prompts] = true}
local function field(f, name)
  for i = 1, #f - 1, 2 do
    if f[i] == name then return f[i + 1] end
  end
  return nil
end
-- the prompt an entry of ``stream`` holds, as its journal's key ends: ``index:epoch``, in the
-- eval lane ``eval:<name>:index:epoch`` (nil without index and epoch)
local function prompt_of(stream, f)
  local index, epoch = field(f, 'index'), field(f, 'epoch')
  if not (index and epoch) then return nil end
  if stream ~= eval_prompts then return index .. ':' .. epoch end
  return 'eval:' .. (field(f, 'eval') or '') .. ':' .. index .. ':' .. epoch
end
-- the prompt a journal is of (its key past ``<base>:episode:``), nil for another key
local prefix = string.sub(state, 1, #state - #':state') .. ':episode:'
local function journal_of(journal)
  if string.sub(journal, 1, #prefix) ~= prefix then return nil end
  local at = string.sub(journal, #prefix + 1)
  if string.match(at, '^%d+:%d+$') or string.match(at, '^eval:[^:]*:%d+:%d+$') then return at end
  return nil
end
-- true: its entry is there; false: gone; nil: no usable pointer
local function pointed(journal, at)
  local ptr = redis.call('HMGET', journal, 'stream', 'entry_id')
  if not (ptr[1] and ptr[2] and streams[ptr[1]]) then return nil end
  local rows = redis.pcall('XRANGE', ptr[1], ptr[2], ptr[2])
  if type(rows) ~= 'table' or rows.err then return nil end
  if not rows[1] then return false end
  if prompt_of(ptr[1], rows[1][2]) == at then return true end
  return nil
end
-- the prompt (``prompt_of``) of every entry of ``lanes``
local function held(lanes)
  local found = {}
  for _, stream in ipairs(lanes) do
    local from = '-'
    while true do
      local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', 1000)
      for _, entry in ipairs(entries) do
        local at = prompt_of(stream, entry[2])
        if at then found[at] = true end
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
  local at = journal_of(journal)
  if at then
    local live = pointed(journal, at)
    if live == false then
      live = in_returned(at)
    elseif live == nil then
      live = in_returned(at) or in_queued(at)
    end
    if not live and drop_journal(journal, state, payload_held, payload_free) then swept = swept + 1 end
  end
end
if swept > 0 then incr(state, '$JOURNALS_SWEPT', swept) end
return swept
