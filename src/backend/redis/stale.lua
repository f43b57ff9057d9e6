-- ARGV: 1 kind, 2 stale_after ms, 3 the key as messages name it ("locks/<name>").
-- Read-only. Returns {key, reason, age ms, detail} entries.
clock()
local bad, found = misfit()
if bad then
  return {{bad, "wrong-type", 0, "key " .. bad .. " of " .. ARGV[3] .. " holds a " .. found ..
    ", which sidelock did not write there; the lock cannot be used until it is removed"}}
end
local after = tonumber(ARGV[2])
local out = {}
-- A fence as the report writes it: an integer, as text; anything a hand
-- wrote there (not a number, past 2^53) as Lua shows it.
local function fence_text(f)
  local n = tonumber(f)
  if n and math.abs(n) < 2^53 then return string.format("%d", n) end
  return tostring(f)
end
local function name(who)
  local ok, os = pcall(cjson.decode, who)
  if ok and type(os) == "table" then return tostring(os[1]), tostring(os[2]) end
  return "?", "?"
end
if IS_LOCK then
  local x = xlease()
  if x and NOW - x.t0 > after then
    out[#out + 1] = {MAIN, "held-too-long", NOW - x.t0,
      "held by " .. x.o .. " on sidecar " .. x.s .. " with fence " .. fence_text(x.f)}
  end
end
local all = redis.call("HGETALL", HOLDERS)
for i = 1, #all, 2 do
  local m = cjson.decode(all[i + 1])
  if IS_LOCK and m.m ~= "s" then
    -- An exclusive holder of an older sidelock: its main key says more.
  elseif m.e <= NOW then
    out[#out + 1] = {MAIN, "expired-not-cleaned", NOW - m.e,
      "holder " .. m.o .. " on sidecar " .. m.s .. " expired but its entry is still stored"}
  elseif NOW - m.t0 > after then
    out[#out + 1] = {MAIN, "held-too-long", NOW - m.t0,
      "held by " .. m.o .. " on sidecar " .. m.s .. " with fence " .. fence_text(m.f)}
  end
end
local beats = {}
local all_beats = redis.call("HGETALL", BEAT)
for i = 1, #all_beats, 2 do beats[all_beats[i]] = tonumber(all_beats[i + 1]) end
for _, e in ipairs(queue()) do
  if not beating(e, beats[e.inst]) then
    local o, s = name(e.who)
    local since = beats[e.inst] or (e.t0 + HEARTBEAT_TTL)
    out[#out + 1] = {MAIN, "orphaned-waiter", NOW - e.t0,
      "waiter " .. o .. " of sidecar " .. s .. " stopped heartbeating " .. (NOW - since) .. " ms ago"}
  end
end
return out
