-- ARGV: 1 kind, 2 channel, 3 index member, 4 token.
-- Returns {now, remaining count} or {now, -1} when the token holds nothing.
local token = ARGV[4]
prune()
local m = meta_of(token)
if not m then return {NOW, -1} end
m.c = m.c - 1
if m.c > 0 then
  redis.call("HSET", HOLDERS, token, cjson.encode(m))
  return {NOW, m.c}
end
drop_lease(token, m)
sync_shared()
tidy_if_idle()
redis.call("PUBLISH", CHANNEL, "r")
return {NOW, 0}
