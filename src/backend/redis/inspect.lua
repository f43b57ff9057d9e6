-- ARGV: 1 kind, 2 channel, 3 index member.
-- Returns {now, fence, limit, holders_json, waiters_json}, or
-- {now, 0, 0, "[]", "[]", key, found} when a key holds something sidelock did
-- not write there (see misfit()).
clock()
inflate()
local bad, found = misfit()
if bad then return {NOW, 0, 0, "[]", "[]", bad, found} end
prune()
local waiters = {}
for _, s in ipairs(redis.call("ZRANGE", QUEUE, 0, -1)) do
  local raw = redis.call("HGET", WAITERS, s)
  if raw then
    local w = cjson.decode(raw)
    waiters[#waiters + 1] = {o = w.o, s = w.s, m = w.m, t0 = w.t0}
  end
end
local wj = "[]"
if #waiters > 0 then wj = cjson.encode(waiters) end
local limit = 0
if not idle() then limit = tonumber(redis.call("GET", LIMIT) or "0") end
tidy_if_idle()
return {NOW, tonumber(redis.call("GET", FENCE) or "0"), limit, holders_json(), wj}
