-- ARGV: 1 kind, 2 channel, 3 index member, 4 token, 5 ttl ms (0: the lease's own).
-- Returns {now, expires} or {now, -1} when the token holds nothing.
clock()
inflate()
local token, ttl = ARGV[4], tonumber(ARGV[5])
prune()
local m = meta_of(token)
if not m then return {NOW, -1} end
if ttl == 0 then ttl = m.ttl end
local e = NOW + ttl
if m.cap > 0 and e > m.cap then e = m.cap end
m.e = e
put_holder(token, m)
redis.call("ZADD", EXPIRY, e, token)
if IS_LOCK then
  if m.m == "x" then
    redis.call("PEXPIRE", MAIN, math.max(e - NOW, 1))
  else
    sync_shared()
  end
end
set_expiries()
return {NOW, e}
