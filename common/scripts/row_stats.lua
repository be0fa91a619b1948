-- Per-row statistics for a curriculum: ``items`` are (field, mean reward, reward variance, version,
-- epoch) of finished groups; each row's JSON keeps its count and the last ``k`` means and variances.
-- KEYS: rows
-- ARGV: k *items
local keep = tonumber(k)
for i = items_at, #ARGV - 4, 5 do
  local s = nil
  local raw = redis.call('HGET', rows, ARGV[i])
  if raw then
    local ok, decoded = pcall(cjson.decode, raw)
    if ok and type(decoded) == 'table' then s = decoded end
  end
  if not s then s = {} end
  local r, v = s.r, s.v
  if type(r) ~= 'table' then r = {} end
  if type(v) ~= 'table' then v = {} end
  table.insert(r, tonumber(ARGV[i + 1]) or 0)
  table.insert(v, tonumber(ARGV[i + 2]) or 0)
  while #r > keep do table.remove(r, 1) end
  while #v > keep do table.remove(v, 1) end
  redis.call('HSET', rows, ARGV[i], cjson.encode({t = (tonumber(s.t) or 0) + 1, r = r, v = v,
    w = tonumber(ARGV[i + 3]) or 0, e = tonumber(ARGV[i + 4]) or 0}))
end
return math.floor((#ARGV - items_at + 1) / 5)
