-- A finished eval's groups (entries of ``eval_groups``) archived as ``evaluated`` (reason: the
-- eval's name) and deleted, and its result stored, in one step: a re-sent call finds them gone.
-- KEYS: eval_groups evals state config archive payload_held payload_free
-- ARGV: name result actor now_ms *ids
-- uses: archive
for i = ids_at, #ARGV do
  archive_fate(config, archive, state, eval_groups, ARGV[i], {'evaluated', name, actor, '', '', 'eval_groups', now_ms},
    payload_held, payload_free)
  redis.call('XDEL', eval_groups, ARGV[i])
end
redis.call('HSET', evals, name, result)
return #ARGV - ids_at + 1
