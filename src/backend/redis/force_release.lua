-- ARGV: 1 kind, 2 channel, 3 index member.
-- Removes every lease (lock-delay from now) and returns their tokens.
prune()
local all = redis.call("HGETALL", HOLDERS)
local tokens = {}
for i = 1, #all, 2 do
  local m = cjson.decode(all[i + 1])
  delay_until(NOW + m.dl)
  drop_lease(all[i], m)
  tokens[#tokens + 1] = all[i]
end
sync_shared()
tidy_if_idle()
if #tokens > 0 then redis.call("PUBLISH", CHANNEL, "f") end
return tokens
