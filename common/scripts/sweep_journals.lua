-- Orphan episode journals (durable episodes) swept: a journal whose prompt ended some other way
-- than PUBLISH or MOVE (an operator's XDEL or dead-letter tooling, a Redis 6.2 XAUTOCLAIM of a
-- deleted entry) would stay forever. A journal is kept while its prompt's entry is in a prompt
-- stream (waiting or pending: a returned prompt waits in ``retry``); the others are deleted with
-- their bytes. A journal names that entry (``stream``, ``entry_id``: written by JOURNAL_APPEND
-- under the lease, moved by the MOVE that returns the prompt), so it is checked with one XRANGE of
-- that id, whatever the streams hold. No other script gives a journaled prompt a new entry in a
-- prompt stream: ADMIT parks only entries never delivered (no journal was written under them),
-- and a recycled or requeued prompt is a new attempt whose journal went with its publish or dead
-- letter. A journal without a pointer (written by an older version), or whose pointer names
-- another prompt, falls back to reading the prompt streams whole for the ``index:epoch`` alive
-- (once per call, only then: linear in the prompts queued). Atomic, so a prompt moving between
-- streams is never missed. ``journals`` are the key names a SCAN found (the caller bounds them
-- with COUNT). Returns how many went.
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
-- true: its entry is there; false: gone; nil: no usable pointer (read the streams)
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
local alive = nil
local function read_alive()
  alive = {}
  for stream in pairs(streams) do
    local from = '-'
    while true do
      local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', 1000)
      for _, entry in ipairs(entries) do
        local index, epoch = field(entry[2], 'index'), field(entry[2], 'epoch')
        if index and epoch then alive[index .. ':' .. epoch] = true end
      end
      if #entries < 1000 then break end
      from = '(' .. entries[#entries][1]
    end
  end
end
local swept = 0
for i = journals_at, #ARGV do
  local journal = ARGV[i]
  local at = string.match(journal, ':episode:(%d+:%d+)$')
  if at then
    local live = pointed(journal, at)
    if live == nil then
      if not alive then read_alive() end
      live = alive[at] == true
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
