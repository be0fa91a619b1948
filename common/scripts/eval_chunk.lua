-- One chunk of an eval's prompts added to the eval lane, and its progress moved from ``before`` to
-- ``after`` (``written:digest``), in one step: a chunk is written whole or not at all, once. A
-- re-sent call that went through finds ``after`` and adds nothing; progress that is neither (another
-- caller resuming the same eval) is returned and nothing is written. Returns 'ok' or the progress.
-- ``entries``: one msgpack array of the prompt entries, each a flat array of field, value strings
-- (one argument: packing thousands of separate arguments costs the caller more than the write).
-- KEYS: eval_prompts eval_submitting
-- ARGV: name before after entries
local progress = redis.call('HGET', eval_submitting, name)
if progress == after then return 'ok' end
if progress ~= before then return progress or '' end
for _, entry in ipairs(cmsgpack.unpack(entries)) do
  redis.call('XADD', eval_prompts, '*', unpack(entry))
end
redis.call('HSET', eval_submitting, name, after)
return 'ok'
