-- An eval whose prompts are all written: its submission (``meta``, now with ``prompts``) stored and
-- its progress closed, in one step, if the progress is still ``progress``. 'ok' (a re-sent call
-- that went through finds no progress: 'ok' too) or 'moved'.
-- KEYS: evals eval_submitting
-- ARGV: name progress meta
local have = redis.call('HGET', eval_submitting, name)
if not have then return 'ok' end
if have ~= progress then return 'moved' end
redis.call('HSET', evals, name, meta)
redis.call('HDEL', eval_submitting, name)
return 'ok'
