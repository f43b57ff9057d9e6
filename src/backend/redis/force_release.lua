-- ARGV: 1 kind, 2 channel, 3 index member.
-- Removes every lease (lock-delay from now) and returns their tokens.
clock()
inflate()
prune()
local h, keys = holders()
local tokens = {}
for _, token in ipairs(keys) do tokens[#tokens + 1] = token end
for _, token in ipairs(tokens) do
  delay_until(NOW + h[token].dl)
  drop_lease(token)
end
sync_shared()
tidy_if_idle()
if #tokens > 0 then redis.call("PUBLISH", CHANNEL, "f") end
return tokens
