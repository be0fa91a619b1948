-- ``version`` '' = unchanged, ``paused`` '1', '0' or '' = unchanged. A version change records
-- where the new version began (version_start_consumed = committed + taken) and what the previous one consumed
-- (prev_version_consumed), in the same step as the version itself: the terms of ADMIT's rule.
-- KEYS: state groups
-- ARGV: version paused channel message trainer_group
-- uses: pending
if version ~= '' then
  local st = redis.call('HMGET', state, '$WEIGHT_VERSION', '$COMMITTED', '$VERSION_START_CONSUMED')
  if st[1] == false or num(st[1]) ~= tonumber(version) then
    local consumed = num(st[2]) + pending(groups, trainer_group)
    redis.call('HSET', state, '$VERSION_START_CONSUMED', consumed,
      '$PREV_VERSION_CONSUMED', math.max(0, consumed - num(st[3])))
  end
  redis.call('HSET', state, '$WEIGHT_VERSION', version)
end
if paused ~= '' then redis.call('HSET', state, '$PAUSED', paused) end
redis.call('PUBLISH', channel, message)
return true
