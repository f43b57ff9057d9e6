-- ARGV: 1 kind, 2 channel, 3 index member, 4 stale_after ms.
-- Read-only. Returns {key, reason, age ms, detail} entries.
clock()
local bad, found = misfit()
if bad then
  return {{bad, "wrong-type", 0, "key " .. bad .. " of " .. ARGV[3] .. " holds a " .. found ..
    ", which sidelock did not write there; the lock cannot be used until it is removed"}}
end
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
local token, short = short_lease()
if token and not short.e then
  local left = redis.call("PTTL", LEASE)
  local ended = NOW
  if left > 0 then ended = math.min(NOW, NOW + left - short.dl - 1000) end
  out[#out + 1] = {MAIN, "expired-not-cleaned", NOW - ended,
    "holder " .. short.o .. " on sidecar " .. short.s .. " expired but its entry is still stored"}
elseif token and NOW - short.t0 > after then
  out[#out + 1] = {MAIN, "held-too-long", NOW - short.t0,
    "held by " .. short.o .. " on sidecar " .. short.s .. " with fence " .. short.f}
end
local lapsed = {}
local beats = redis.call("HGETALL", BEAT)
for i = 1, #beats, 2 do
  if tonumber(beats[i + 1]) <= NOW then lapsed[beats[i]] = tonumber(beats[i + 1]) end
end
for _, s in ipairs(redis.call("ZRANGE", QUEUE, 0, -1)) do
  local raw = redis.call("HGET", WAITERS, s)
  if raw then
    local w = cjson.decode(raw)
    if lapsed[w.s] then
      out[#out + 1] = {MAIN, "orphaned-waiter", NOW - w.t0,
        "waiter " .. w.o .. " of sidecar " .. w.s .. " stopped heartbeating " .. (NOW - lapsed[w.s]) .. " ms ago"}
    end
  end
end
return out
