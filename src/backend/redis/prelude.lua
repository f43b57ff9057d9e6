-- Shared by every sidelock script. One lock's keys all carry the hash tag
-- {<prefix><name>} (the main key is the tag's content), so they share a
-- Cluster slot and each script is atomic on one node.
--
-- KEYS: 1 main (token of the exclusive holder, or SHARED while shared holders
-- exist; the classic SET NX PX key), 2 holders (hash token -> JSON meta),
-- 3 expiry (zset token -> expires ms), 4 fence (counter, never expires),
-- 5 queue (zset seq -> seq), 6 waiters (hash seq -> JSON meta), 7 heartbeat
-- (hash sidecar -> deadline ms: one entry per sidecar with waiters, so
-- keeping waiters alive costs the same for one waiter as for thousands), 8 delay (lock-delay end, with PX), 9 limit
-- (semaphore permits while in use), 10 seq (ticket counter), 11 index (zset
-- of keys in use; absent in a Cluster, where it lives in another slot).
-- ARGV[1] is the kind: "l" (lock) or "s" (semaphore); ARGV[2] the wake channel.

local SHARED = "sidelock:shared"
local MAIN, HOLDERS, EXPIRY, FENCE, QUEUE, WAITERS, BEAT, DELAY, LIMIT, SEQ =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local INDEX = KEYS[11] or ""
local IS_LOCK = ARGV[1] == "l"
local CHANNEL = ARGV[2]

local t = redis.call("TIME")
local NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)

local function meta_of(token)
  local raw = redis.call("HGET", HOLDERS, token)
  if raw then return cjson.decode(raw) end
  return nil
end

local function delay_until(ms)
  if ms > NOW then
    local cur = tonumber(redis.call("GET", DELAY) or "0")
    if ms > cur then redis.call("SET", DELAY, ms, "PX", ms - NOW) end
  end
end

local function drop_lease(token, m)
  redis.call("HDEL", HOLDERS, token)
  redis.call("ZREM", EXPIRY, token)
  if IS_LOCK and redis.call("GET", MAIN) == token then redis.call("DEL", MAIN) end
end

-- The main key mirrors shared holders: SHARED, expiring with the last of them.
local function sync_shared()
  if not IS_LOCK then return end
  local main = redis.call("GET", MAIN)
  if main and main ~= SHARED then return end
  local last = redis.call("ZRANGE", EXPIRY, -1, -1, "WITHSCORES")
  if #last == 0 then
    if main then redis.call("DEL", MAIN) end
    return
  end
  local until_ms = tonumber(last[2])
  if until_ms > NOW then redis.call("SET", MAIN, SHARED, "PX", until_ms - NOW) end
end

local function idle()
  return redis.call("ZCARD", EXPIRY) == 0 and redis.call("ZCARD", QUEUE) == 0
end

-- The earliest heartbeat deadline of a sidecar with waiters here.
local function first_lapse()
  local first = 0
  local beats = redis.call("HGETALL", BEAT)
  for i = 2, #beats, 2 do
    local d = tonumber(beats[i])
    if first == 0 or d < first then first = d end
  end
  return first
end

local function tidy_if_idle()
  if idle() then
    redis.call("DEL", LIMIT, BEAT)
    if INDEX ~= "" then redis.call("ZREM", INDEX, ARGV[3] or "") end
  end
end

-- Drops leases past their expiry (starting their lock-delay), exclusive
-- leases whose main key was deleted or overwritten behind our back, and
-- waiters whose sidecar stopped heartbeating. Publishes if anything went.
local function prune()
  local changed = false
  for _, token in ipairs(redis.call("ZRANGEBYSCORE", EXPIRY, "-inf", NOW)) do
    local m = meta_of(token)
    if m then delay_until(m.e + m.dl) end
    drop_lease(token, m)
    changed = true
  end
  if IS_LOCK then
    local main = redis.call("GET", MAIN)
    local all = redis.call("HGETALL", HOLDERS)
    for i = 1, #all, 2 do
      local m = cjson.decode(all[i + 1])
      if m.m == "x" and main ~= all[i] then
        delay_until(NOW + m.dl)
        redis.call("HDEL", HOLDERS, all[i])
        redis.call("ZREM", EXPIRY, all[i])
        changed = true
      end
    end
  end
  local lapsed = {}
  local any_lapsed = false
  local beats = redis.call("HGETALL", BEAT)
  for i = 1, #beats, 2 do
    if tonumber(beats[i + 1]) <= NOW then
      lapsed[beats[i]] = true
      any_lapsed = true
      redis.call("HDEL", BEAT, beats[i])
    end
  end
  if any_lapsed then
    for _, s in ipairs(redis.call("ZRANGE", QUEUE, 0, -1)) do
      local raw = redis.call("HGET", WAITERS, s)
      if (not raw) or lapsed[cjson.decode(raw).s] then
        redis.call("ZREM", QUEUE, s)
        redis.call("HDEL", WAITERS, s)
        changed = true
      end
    end
  end
  if changed then
    sync_shared()
    redis.call("PUBLISH", CHANNEL, "p")
  end
  return changed
end

-- Side keys expire with what they describe, so a lock every sidecar
-- abandoned disappears by itself: holder keys with the last lease, queue
-- keys with the last heartbeat. The fence and ticket counters never expire.
local function set_expiries()
  -- Holder entries outlive their lease by its lock-delay (and a second), so
  -- the script that finds a lease expired can still start its lock-delay.
  local keep = 0
  local all = redis.call("HGETALL", HOLDERS)
  for i = 2, #all, 2 do
    local m = cjson.decode(all[i])
    keep = math.max(keep, m.e + m.dl + 1000)
  end
  if keep > NOW then
    redis.call("PEXPIRE", HOLDERS, keep - NOW)
    redis.call("PEXPIRE", EXPIRY, keep - NOW)
  end
  local latest = 0
  local beats = redis.call("HGETALL", BEAT)
  for i = 2, #beats, 2 do latest = math.max(latest, tonumber(beats[i])) end
  if latest > NOW then
    for _, k in ipairs({QUEUE, WAITERS, BEAT}) do redis.call("PEXPIRE", k, latest - NOW) end
  end
end

-- Holders as a JSON array (no tokens), including a foreign holder of the
-- main key (a legacy SET NX PX client).
local function holders_json()
  local list = {}
  local all = redis.call("HGETALL", HOLDERS)
  for i = 1, #all, 2 do
    local m = cjson.decode(all[i + 1])
    list[#list + 1] = {o = m.o, s = m.s, m = m.m, f = m.f, c = m.c, t0 = m.t0, e = m.e}
  end
  if IS_LOCK then
    local main = redis.call("GET", MAIN)
    if main and main ~= SHARED and redis.call("HEXISTS", HOLDERS, main) == 0 then
      local pttl = redis.call("PTTL", MAIN)
      local e = 0
      if pttl > 0 then e = NOW + pttl end
      list[#list + 1] = {o = "(foreign)", s = "", m = "x", f = 0, c = 1, t0 = 0, e = e}
    end
  end
  if #list == 0 then return "[]" end
  return cjson.encode(list)
end
