-- ARGV: 1 kind, 2 channel, 3 index member, 4 stale_after ms.
-- Read-only. Returns {key, reason, age ms, detail} entries.
local after = tonumber(ARGV[4])
local out = {}
local all = redis.call("HGETALL", HOLDERS)
for i = 1, #all, 2 do
  local m = cjson.decode(all[i + 1])
  if m.e <= NOW then
    out[#out + 1] = {MAIN, "expired-not-cleaned", NOW - m.e,
      "holder " .. m.o .. " on sidecar " .. m.s .. " expired but its entry is still stored"}
  elseif NOW - m.t0 > after then
    out[#out + 1] = {MAIN, "held-too-long", NOW - m.t0,
      "held by " .. m.o .. " on sidecar " .. m.s .. " with fence " .. m.f}
  end
end
for _, s in ipairs(redis.call("ZRANGEBYSCORE", BEAT, "-inf", NOW)) do
  local raw = redis.call("HGET", WAITERS, s)
  local w = {o = "?", s = "?", t0 = NOW}
  if raw then w = cjson.decode(raw) end
  out[#out + 1] = {MAIN, "orphaned-waiter", NOW - w.t0,
    "waiter " .. w.o .. " of sidecar " .. w.s .. " stopped heartbeating"}
end
return out
