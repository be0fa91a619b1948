-- Records an eval's submission (``meta``, JSON without ``prompts`` yet) and opens its progress
-- (``0:``, see eval_submitting) in one step. A name already recorded: {'resume', meta, progress}
-- while its prompts are still being written (a submission cut short: killed, cancelled, an outage),
-- else {'taken', meta}. Returns {'new', meta, progress} for a new one.
-- KEYS: evals eval_submitting
-- ARGV: name meta
local have = redis.call('HGET', evals, name)
if have then
  local progress = redis.call('HGET', eval_submitting, name)
  if progress then return {'resume', have, progress} end
  return {'taken', have}
end
redis.call('HSET', evals, name, meta)
redis.call('HSET', eval_submitting, name, '0:')
return {'new', meta, '0:'}
