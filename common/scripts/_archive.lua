-- The archive of fates (DESIGN §4.19), used by the scripts that decide a fate: while the
-- namespace's config has an ``archive_bytes`` budget, a copy of entry ``id`` of ``src`` goes to the
-- archive stream with ``meta`` = {fate, reason, actor, step, position, kind, ts_ms} in front of
-- its own fields, in the same step as the hand-over. The archive never refuses a hand-over: the
-- oldest records are deleted (``archive_dropped``) until the new one fits; one larger than the
-- whole budget is dropped itself. ``record_bytes`` is the record's size in the ledger.
-- A record of an entry with payload objects (``refs``) refers to them in its place (the archiver
-- reads them with ``--keep-arrays``), and their bytes count in its size; a dropped record releases
-- them (``release``, into ``free``); the archiver's confirmation (ARCHIVED) releases the others.
-- Returns true when the record was added (it then holds the entry's objects). ``kept`` (nil or
-- '' = none): the refs of the entry that replaces this one (a recycled group's retry prompt
-- continues its partial samples from the same objects); when they name all of the record's
-- objects the record is written without them (no ``refs``, no ``store_bytes``): one set has one
-- holder, the new entry, and the record cannot free it under it.
local function archive_fate(cfg, akey, state, src, id, meta, held, free, kept)
  local budget = num(redis.call('HGET', cfg, 'archive_bytes'))
  if budget <= 0 then return false end
  local rows = redis.call('XRANGE', src, id, id)
  if #rows == 0 then return false end
  local f = rows[1][2]
  local own = refs_of(f)
  if kept and kept ~= '' and own ~= '' then
    local all = true
    local padded = ' ' .. kept .. ' '
    for key in string.gmatch(own, '%S+') do
      if not string.find(padded, ' ' .. key .. ' ', 1, true) then all = false end
    end
    if all then
      local g = {}
      for i = 1, #f - 1, 2 do
        if f[i] ~= 'refs' and f[i] ~= 'store_bytes' then g[#g + 1] = f[i] g[#g + 1] = f[i + 1] end
      end
      f = g
    end
  end
  local size = 64
  for i = 1, #f do size = size + #f[i] end
  for i = 1, #f - 1, 2 do if f[i] == 'store_bytes' then size = size + num(f[i + 1]) end end
  for i = 1, #meta do size = size + #meta[i] end
  local held_bytes = num(redis.call('HGET', state, '$ARCHIVE_BYTES'))
  local dropped = 0
  while held_bytes > 0 and held_bytes + size > budget do
    local first = redis.call('XRANGE', akey, '-', '+', 'COUNT', 1)
    if #first == 0 then held_bytes = 0 break end
    local ff, fb = first[1][2], 0
    for i = 1, #ff - 1, 2 do if ff[i] == 'record_bytes' then fb = num(ff[i + 1]) break end end
    release(refs_of(ff), '', held, free, state, meta[7])
    redis.call('XDEL', akey, first[1][1])
    held_bytes = math.max(0, held_bytes - fb)
    dropped = dropped + 1
  end
  local added = false
  if size > budget then
    dropped = dropped + 1
  else
    added = true
    local version = redis.call('HGET', state, '$WEIGHT_VERSION') or '0'
    redis.call('XADD', akey, '*', 'fate', meta[1], 'reason', meta[2], 'actor', meta[3], 'step', meta[4],
      'position', meta[5], 'kind', meta[6], 'ts_ms', meta[7], 'trainer_version', version, 'entry_id', id,
      'record_bytes', size, unpack(f))
    held_bytes = held_bytes + size
    incr(state, '$ARCHIVE_RECORDED', 1)
  end
  redis.call('HSET', state, '$ARCHIVE_BYTES', held_bytes)
  if dropped > 0 then incr(state, '$ARCHIVE_DROPPED', dropped) end
  return added
end
