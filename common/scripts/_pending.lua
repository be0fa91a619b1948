-- Shared by ADMIT and SET_VERSION: a consumer group's pending count (0 when the stream or group
-- does not exist). XINFO GROUPS, not XPENDING: XPENDING's summary walks every consumer of the
-- group and lists each one's count (two per producer in ADMIT, which every producer runs for
-- every group it starts), XINFO GROUPS reads each group's pending-list size once (O(groups):
-- one group per stream). docs/scale.md has the before/after.
local function pending(key, group)
  local groups = redis.pcall('XINFO', 'GROUPS', key)
  if type(groups) ~= 'table' or groups.err then return 0 end
  for _, g in ipairs(groups) do
    for i = 1, #g - 1, 2 do
      if g[i] == 'name' and g[i + 1] ~= group then break end
      if g[i] == 'pending' then return tonumber(g[i + 1]) or 0 end
    end
  end
  return 0
end
