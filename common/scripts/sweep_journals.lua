-- Orphan episode journals (durable episodes) swept: a journal whose prompt ended some other way
-- than PUBLISH or MOVE (an operator's XDEL or dead-letter tooling, a Redis 6.2 XAUTOCLAIM of a
-- deleted entry) would stay forever. A journal is kept while an entry with its ``index`` and
-- ``epoch`` is in a prompt stream (waiting or pending: a returned prompt waits in ``retry``);
-- the others are deleted with their bytes. Atomic, so a prompt moving between streams (MOVE,
-- ADMIT's parking) is never missed. ``journals`` are the key names a SCAN found (the caller
-- bounds them with COUNT); the streams are read only when there are some. Returns how many went.
-- KEYS: prompts retry eval_prompts state
-- ARGV: *journals
if #ARGV < journals_at then return 0 end
local alive = {}
for _, stream in ipairs({prompts, retry, eval_prompts}) do
  local from = '-'
  while true do
    local entries = redis.call('XRANGE', stream, from, '+', 'COUNT', 1000)
    for _, entry in ipairs(entries) do
      local f, index, epoch = entry[2], nil, nil
      for i = 1, #f - 1, 2 do
        if f[i] == 'index' then index = f[i + 1] elseif f[i] == 'epoch' then epoch = f[i + 1] end
      end
      if index and epoch then alive[index .. ':' .. epoch] = true end
    end
    if #entries < 1000 then break end
    from = '(' .. entries[#entries][1]
  end
end
local swept = 0
for i = journals_at, #ARGV do
  local journal = ARGV[i]
  local at = string.match(journal, ':episode:(%d+:%d+)$')
  if at and not alive[at] then
    local b = num(redis.call('HGET', journal, 'bytes'))
    if redis.call('DEL', journal) == 1 then
      swept = swept + 1
      if b > 0 and incr(state, '$JOURNAL_BYTES', -b) < 0 then redis.call('HSET', state, '$JOURNAL_BYTES', 0) end
    end
  end
end
if swept > 0 then incr(state, '$JOURNALS_SWEPT', swept) end
return swept
