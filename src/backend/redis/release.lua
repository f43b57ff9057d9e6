-- ARGV: 1 kind, 2 channel, 3 index member, 4 token.
-- Returns {now, remaining count} or {now, -1} when the token holds nothing
-- (now is 0 when the fast path did not need the clock).
-- The common cases run first, in release_fast.lua.
local token = ARGV[4]
inflate()

-- Wakes whoever may be admitted now. When the queue's head is an exclusive
-- claim on a lock, nobody behind it can be: the message names its ticket
-- ("h<seq>"), and only the sidecar whose local head holds that ticket wakes
-- it, where "r" wakes every sidecar's head (all but one to find it busy).
local function publish_release()
  if IS_LOCK then
    local head = redis.call("ZRANGE", QUEUE, 0, 0)[1]
    if head then
      local raw = redis.call("HGET", WAITERS, head)
      if raw and cjson.decode(raw).m == "x" then
        redis.call("PUBLISH", CHANNEL, "h" .. head)
        return
      end
    end
  end
  redis.call("PUBLISH", CHANNEL, "r")
end

-- The exclusive holder releasing its last hold while others hold or wait.
-- Its lease is live (the main key expires with it), so prune() can only
-- matter for what is left after it goes. A re-entered hold (count above 1)
-- only counts down, below.
local exclusive = IS_LOCK and main_get() == token and meta_of(token)
if exclusive and exclusive.c <= 1 then
  drop_lease(token)
  clock()
  prune()
  sync_shared()
  tidy_if_idle()
  publish_release()
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
publish_release()
return {NOW, 0}
