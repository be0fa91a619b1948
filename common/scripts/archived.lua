-- The archiver's confirmation: ``pairs`` are (archive id, record size) of records written to
-- Parquet; each one still in the stream is deleted and leaves the ledger (one the budget dropped
-- meanwhile changes nothing). ``cursor`` is the last id written, for ``inspect``. Only the archiver
-- holding the namespace's lease (``token``) confirms: a stalled one whose lease lapsed changes
-- nothing and is told so (-1), as a successor may have written the same records. A record's
-- payload objects (``refs``) are released with it: the archiver read them first (``--keep-arrays``).
-- KEYS: archive state lease payload_held payload_free
-- ARGV: token cursor now_ms *pairs
if redis.call('GET', lease) ~= token then return -1 end
local gone, freed = 0, 0
for i = pairs_at, #ARGV - 1, 2 do
  local rows = redis.call('XRANGE', archive, ARGV[i], ARGV[i])
  if #rows > 0 then release(refs_of(rows[1][2]), '', payload_held, payload_free, state, now_ms) end
  if redis.call('XDEL', archive, ARGV[i]) == 1 then
    gone = gone + 1
    freed = freed + num(ARGV[i + 1])
  end
end
if freed > 0 and incr(state, '$ARCHIVE_BYTES', -freed) < 0 then redis.call('HSET', state, '$ARCHIVE_BYTES', 0) end
if gone > 0 then incr(state, '$ARCHIVED', gone) end
if cursor ~= '' then redis.call('HSET', state, '$ARCHIVE_CURSOR', cursor) end
redis.call('HSET', state, '$ARCHIVE_SEEN_MS', now_ms)
return gone
