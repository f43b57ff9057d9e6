-- ARGV: 1 kind, 2 channel, 3 index member, 4 token.
-- Returns {now, remaining count} or {now, -1} when the token holds nothing
-- (now is 0 when the fast path did not need the clock).
-- The common cases run first, in release_fast.lua.
local token = ARGV[4]

-- The exclusive holder releasing its last hold while others hold or wait.
-- Its lease is live (the main key expires with it), so prune() can only
-- matter for what is left after it goes.
if IS_LOCK and main_get() == token and meta_of(token) then
  drop_lease(token)
  clock()
  prune()
  sync_shared()
  tidy_if_idle()
  redis.call("PUBLISH", CHANNEL, "r")
  return {NOW, 0}
end

clock()
prune()
local m = meta_of(token)
if not m then return {NOW, -1} end
m.c = m.c - 1
if m.c > 0 then
  put_holder(token, m)
  return {NOW, m.c}
end
drop_lease(token)
sync_shared()
tidy_if_idle()
redis.call("PUBLISH", CHANNEL, "r")
return {NOW, 0}
