-- ARGV: 1 kind, 2 token, 3 how the lock passes to the next claim in line
-- (hand_over()'s mode), 4 this sidecar's process (instance): its own
-- waiters need no heartbeat check, 5 the stem of sidecars' own channels (see
-- hand_over()).
-- Returns {now, remaining count} or {now, -1} when the token holds nothing
-- (now is 0 when the fast path did not need the clock), and third, when the
-- lock passed to a claim of this sidecar's process, its grant as the
-- message on its own channel would have told it (hand_over()'s KEPT). The
-- fast path, which leaves no holds, answers 0 or that grant alone.
-- The common case runs first, in release_fast.lua.
local token = ARGV[2]
clock()
local x = IS_LOCK and xlease()
if x and x.token == token then
  x.c = x.c - 1
  if x.c > 0 then
    xlease_put(x)
    return {NOW, x.c}
  end
  if not hand_over(ARGV[3], ARGV[4], ARGV[5], true) then main_del() end
  return {NOW, 0, KEPT}
end

prune()
local m = meta_of(token)
if not m or (IS_LOCK and m.m ~= "s") then return {NOW, -1} end
m.c = m.c - 1
if m.c > 0 then
  put_holder(token, m)
  return {NOW, m.c}
end
drop_shared(token)
sync_shared()
tidy_if_idle()
if not IS_LOCK then
  hand_over("0", ARGV[4], ARGV[5])
elseif not main_get() then
  if not hand_over(ARGV[3], ARGV[4], ARGV[5], true) then main_del() end
else
  redis.call("PUBLISH", TAG .. "wake", "r")
end
return {NOW, 0, KEPT}
