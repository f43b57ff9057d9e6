-- ARGV: 1 kind.
-- Returns {now, fence, limit, holders, waiters} (holders as holder_rows()
-- writes them, waiters as {[owner, sidecar] as JSON, mode, since}), or
-- {now, 0, 0, {}, {}, key, found} when a key holds something sidelock did
-- not write there (see misfit()).
clock()
local bad, found = misfit()
if bad then return {NOW, 0, 0, {}, {}, bad, found} end
prune()
local waiters = {}
for _, e in ipairs(queue()) do
  waiters[#waiters + 1] = {e.who, e.m, e.t0}
end
local limit = 0
if not idle() then limit = tonumber(redis.call("GET", LIMIT) or "0") end
tidy_if_idle()
return {NOW, tonumber(redis.call("GET", FENCE) or "0"), limit, holder_rows(), waiters}
