-- ARGV: 1 kind, 2 channel, 3 index member, 4 token.
-- Returns {now, remaining count} or {now, -1} when the token holds nothing
-- (now is 0 when the fast path did not need the clock).
local token = ARGV[4]

-- Fast path: the exclusive holder releasing. Its lease is live (the main
-- key expires with it), so prune() can only matter for what is left after
-- it goes, and only when something is left.
if IS_LOCK and main_get() == token then
  local m = meta_of(token)
  if m then
    if m.c > 1 then
      m.c = m.c - 1
      put_holder(token, m)
      return {NOW, m.c}
    end
    drop_lease(token)
    -- Nobody else holds or waits: nobody to wake, only the idle tidy-up.
    if idle() then
      tidy()
      return {NOW, 0}
    end
    clock()
    prune()
    sync_shared()
    tidy_if_idle()
    redis.call("PUBLISH", CHANNEL, "r")
    return {NOW, 0}
  end
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
