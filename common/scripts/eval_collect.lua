-- Groups of a running eval (entries of ``eval_groups``) folded into its rows and archived as
-- ``evaluated`` (reason: the eval's name) and deleted, in one step: ``rows`` (JSON: prompt index ->
-- its compact row) go into the eval's ``eval_rows`` hash (by index: a re-sent call writes the same),
-- the groups' ``freed`` bytes leave the eval lane's ledger, and the number of rows held is returned
-- (the eval is finished when it equals its prompts). ``eval_groups`` thus stays bounded (ADMIT)
-- while an eval larger than the bound runs, as long as ``eval_results`` is called.
-- KEYS: eval_groups rows state config archive
-- ARGV: name actor now_ms freed rows_json *ids
-- uses: archive
local removed = 0
for i = ids_at, #ARGV do
  archive_fate(config, archive, state, eval_groups, ARGV[i], {'evaluated', name, actor, '', '', 'eval_groups', now_ms})
  removed = removed + redis.call('XDEL', eval_groups, ARGV[i])
end
for index, row in pairs(cjson.decode(rows_json)) do
  redis.call('HSET', rows, index, row)
end
if removed > 0 then
  local left = num(redis.call('HGET', state, '$EVAL_BYTES')) - tonumber(freed)
  redis.call('HSET', state, '$EVAL_BYTES', math.max(0, left))
end
return redis.call('HLEN', rows)
