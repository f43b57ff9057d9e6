-- ARGV: 1 kind, 2 token, 3 ttl ms (0: the lease's own).
-- Returns {now, expires} or {now, -1} when the token holds nothing.
-- An exclusive lease is renewed in renew_fast.lua.
local token, ttl = ARGV[2], tonumber(ARGV[3])
clock()
prune()
local m = meta_of(token)
if not m or (IS_LOCK and m.m ~= "s") then return {NOW, -1} end
if ttl == 0 then ttl = m.ttl end
local e = NOW + ttl
if m.cap > 0 and e > m.cap then e = m.cap end
-- Never sooner than it ends now: a re-entry (through any sidecar) may have
-- given it longer, and told its client so.
if m.e > e then e = m.e end
m.e = e
put_holder(token, m)
redis.call("ZADD", EXPIRY, e, token)
sync_shared()
set_expiries()
return {NOW, e}
