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
-- (semaphore permits while in use), 10 seq (ticket counter), 11 lease (an
-- exclusive lease in short form, see short_lease()), 12 index (zset of keys
-- in use; absent in a Cluster, where it lives in another slot).
-- ARGV[1] is the kind: "l" (lock) or "s" (semaphore); ARGV[2] the wake channel.

local SHARED = "sidelock:shared"
local MAIN, HOLDERS, EXPIRY, FENCE, QUEUE, WAITERS, BEAT, DELAY, LIMIT, SEQ =
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8], KEYS[9], KEYS[10]
local LEASE = KEYS[11]
local INDEX = KEYS[12] or ""
local IS_LOCK = ARGV[1] == "l"
local CHANNEL = ARGV[2]

-- The server clock in ms, read by clock() at most once: scripts and paths
-- that never look at the time do not pay for TIME.
local NOW = 0
local function clock()
  if NOW == 0 then
    local t = redis.call("TIME")
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end

-- The main key, the holders hash and the heartbeat hash are read at most
-- once per script run and then kept here (a script is atomic and key expiry
-- is frozen while it runs); every write to them goes through the helpers
-- below so the copies stay true. MAIN_V: nil until read, false when absent.
local MAIN_V
local H, HKEYS -- token -> decoded meta; tokens in the hash's order
local B -- sidecar -> heartbeat deadline
-- What this run changed, so set_expiries() only resets what moved.
local holders_put, beats_put = false, false

-- A main key that is not a string (a hash, list, … written by hand): it
-- equals no token and not SHARED, so it is a foreign holder like a legacy
-- SET NX key, and nothing of sidelock's ever overwrites it.
local FOREIGN = {}

local function main_get()
  if MAIN_V == nil then
    local v = redis.pcall("GET", MAIN)
    if type(v) == "table" and v.err then v = FOREIGN end
    MAIN_V = v
  end
  return MAIN_V
end

-- Redis does not undo a script's writes when a later command fails, so a
-- script that grants checks first that every key it may write is absent or
-- of the type sidelock writes there (and that counters are numbers): the
-- first key that is not, and what it is; nil when all fit. The main key is
-- not checked: any type there is a foreign holder (main_get).
local function misfit()
  local want = {{HOLDERS, "hash"}, {EXPIRY, "zset"}, {FENCE, "number"}, {QUEUE, "zset"},
                {WAITERS, "hash"}, {BEAT, "hash"}, {DELAY, "number"}, {LIMIT, "number"},
                {SEQ, "number"}, {LEASE, "string"}}
  if INDEX ~= "" then want[#want + 1] = {INDEX, "zset"} end
  for _, w in ipairs(want) do
    local found = redis.call("TYPE", w[1]).ok
    if found ~= "none" then
      if w[2] == "number" then
        if found ~= "string" then return w[1], found end
        if not tonumber(redis.call("GET", w[1])) then return w[1], "string that is not a number" end
      elseif found ~= w[2] then
        return w[1], found
      end
    end
  end
  return nil
end

local function main_set(v, px)
  redis.call("SET", MAIN, v, "PX", px)
  MAIN_V = v
end

local function main_del()
  redis.call("DEL", MAIN)
  MAIN_V = false
end

local function holders()
  if not H then
    H, HKEYS = {}, {}
    local all = redis.call("HGETALL", HOLDERS)
    for i = 1, #all, 2 do
      H[all[i]] = cjson.decode(all[i + 1])
      HKEYS[#HKEYS + 1] = all[i]
    end
  end
  return H, HKEYS
end

local function meta_of(token)
  if H then return H[token] end
  local raw = redis.call("HGET", HOLDERS, token)
  if raw then return cjson.decode(raw) end
  return nil
end

local function put_holder(token, m)
  redis.call("HSET", HOLDERS, token, cjson.encode(m))
  holders_put = true
  if H then
    if not H[token] then HKEYS[#HKEYS + 1] = token end
    H[token] = m
  end
end

local function del_holder(token)
  redis.call("HDEL", HOLDERS, token)
  if H and H[token] then
    H[token] = nil
    for i, t in ipairs(HKEYS) do
      if t == token then table.remove(HKEYS, i) break end
    end
  end
end

local function beats()
  if not B then
    B = {}
    local all = redis.call("HGETALL", BEAT)
    for i = 1, #all, 2 do B[all[i]] = tonumber(all[i + 1]) end
  end
  return B
end

local function put_beat(sidecar, deadline)
  redis.call("HSET", BEAT, sidecar, deadline)
  beats_put = true
  if B then B[sidecar] = deadline end
end

local function delay_until(ms)
  if ms > NOW then
    local cur = tonumber(redis.call("GET", DELAY) or "0")
    if ms > cur then redis.call("SET", DELAY, ms, "PX", ms - NOW) end
  end
end

local function drop_lease(token)
  del_holder(token)
  redis.call("ZREM", EXPIRY, token)
  if IS_LOCK and main_get() == token then main_del() end
end

-- The main key mirrors shared holders: SHARED, expiring with the last of them.
local function sync_shared()
  if not IS_LOCK then return end
  local main = main_get()
  if main and main ~= SHARED then return end
  local last = redis.call("ZRANGE", EXPIRY, -1, -1, "WITHSCORES")
  if #last == 0 then
    if main then main_del() end
    return
  end
  local until_ms = tonumber(last[2])
  if until_ms > NOW then main_set(SHARED, until_ms - NOW) end
end

-- Empty sets and hashes do not exist in Redis.
local function idle()
  return redis.call("EXISTS", EXPIRY, QUEUE) == 0
end

-- The earliest heartbeat deadline of a sidecar with waiters here.
local function first_lapse()
  local first = 0
  for _, d in pairs(beats()) do
    if first == 0 or d < first then first = d end
  end
  return first
end

-- What an idle key no longer needs: its limit, heartbeats and index entry.
local function tidy()
  redis.call("DEL", LIMIT, BEAT)
  if B then B = {} end
  -- The index is a hint for listings: a broken one must not fail the script.
  if INDEX ~= "" then redis.pcall("ZREM", INDEX, ARGV[3] or "") end
end

local function tidy_if_idle()
  if idle() then tidy() end
end

-- Drops leases past their expiry (starting their lock-delay), exclusive
-- leases whose main key was deleted or overwritten behind our back, and
-- waiters whose sidecar stopped heartbeating. Publishes if anything went.
local function prune()
  local changed = false
  if IS_LOCK then holders() end
  for _, token in ipairs(redis.call("ZRANGEBYSCORE", EXPIRY, "-inf", NOW)) do
    local m = meta_of(token)
    if m then delay_until(m.e + m.dl) end
    drop_lease(token)
    changed = true
  end
  if IS_LOCK then
    local main = main_get()
    local h, keys = holders()
    local gone = {}
    for _, token in ipairs(keys) do
      local m = h[token]
      if m.m == "x" and main ~= token then
        delay_until(NOW + m.dl)
        gone[#gone + 1] = token
      end
    end
    for _, token in ipairs(gone) do
      del_holder(token)
      redis.call("ZREM", EXPIRY, token)
      changed = true
    end
  end
  local lapsed = {}
  local any_lapsed = false
  local b = beats()
  for sidecar, d in pairs(b) do
    if d <= NOW then
      lapsed[sidecar] = true
      any_lapsed = true
    end
  end
  for sidecar in pairs(lapsed) do
    redis.call("HDEL", BEAT, sidecar)
    b[sidecar] = nil
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
-- Only what this run wrote moves a deadline (removals leave the keys'
-- expiry at most later than needed), so only that is reset.
local function set_expiries()
  if holders_put then
    -- Holder entries outlive their lease by its lock-delay (and a second), so
    -- the script that finds a lease expired can still start its lock-delay.
    local keep = 0
    for _, m in pairs(holders()) do
      keep = math.max(keep, m.e + m.dl + 1000)
    end
    if keep > NOW then
      redis.call("PEXPIRE", HOLDERS, keep - NOW)
      redis.call("PEXPIRE", EXPIRY, keep - NOW)
    end
  end
  if beats_put then
    local latest = 0
    for _, d in pairs(beats()) do latest = math.max(latest, d) end
    if latest > NOW then
      for _, k in ipairs({QUEUE, WAITERS, BEAT}) do redis.call("PEXPIRE", k, latest - NOW) end
    end
  end
end

-- Holders as a JSON array (no tokens), including a foreign holder of the
-- main key (a legacy SET NX PX client).
local function holders_json()
  local list = {}
  local h, keys = holders()
  for _, token in ipairs(keys) do
    local m = h[token]
    list[#list + 1] = {o = m.o, s = m.s, m = m.m, f = m.f, c = m.c, t0 = m.t0, e = m.e}
  end
  if IS_LOCK then
    local main = main_get()
    if main and main ~= SHARED and not h[main] then
      local pttl = redis.call("PTTL", MAIN)
      local e = 0
      if pttl > 0 then e = NOW + pttl end
      list[#list + 1] = {o = "(foreign)", s = "", m = "x", f = 0, c = 1, t0 = 0, e = e}
    end
  end
  if #list == 0 then return "[]" end
  return cjson.encode(list)
end

-- A lease granted by the short path (acquire_fast.lua) is kept in two
-- strings: the main key, and the lease key "<token> <fence> <TIME s> <TIME
-- µs> <ttl> <max_hold> <lock_delay> <[owner, sidecar] as JSON>", expiring
-- with the lease plus its lock-delay and a second, as holder entries do.
-- The holders hash and the expiry set do not exist then, and nobody queues.
-- Its fields, or nil when the key is absent or not of that form; e is the
-- lease's expiry while the main key still holds it, else nil.
local function short_lease()
  local raw = redis.pcall("GET", LEASE)
  if type(raw) ~= "string" then return nil end
  local token, f, sec, usec, ttl, mh, dl, who =
    string.match(raw, "^(%x+) (%d+) (%d+) (%d+) (%d+) (%d+) (%d+) (.*)$")
  if not token then return nil end
  local ok, names = pcall(cjson.decode, who)
  if not ok or type(names) ~= "table" then return nil end
  local t0 = tonumber(sec) * 1000 + math.floor(tonumber(usec) / 1000)
  local m = {o = tostring(names[1]), s = tostring(names[2]), m = "x", f = tonumber(f), c = 1,
             t0 = t0, ttl = tonumber(ttl), cap = 0, dl = tonumber(dl)}
  if tonumber(mh) > 0 then m.cap = t0 + tonumber(mh) end
  if main_get() == token then
    local pttl = redis.call("PTTL", MAIN)
    if pttl > 0 then m.e = clock() + pttl else m.e = clock() + m.ttl end
  end
  return token, m
end

-- Gives a short-form lease the full form (holder entry, expiry member) so
-- that the rest of the script sees every holder in HOLDERS and EXPIRY; a
-- short lease that ended (expired, or its main key deleted or overwritten)
-- only starts its lock-delay, from its expiry or from now, as prune() does.
-- Every script that reads or changes holders calls it first; nothing is
-- written when a key it would write holds something else (misfit()).
local function inflate()
  if not IS_LOCK or not LEASE then return end
  local token, m = short_lease()
  if not token or misfit() then return end
  clock()
  if m.e then
    put_holder(token, m)
    redis.call("ZADD", EXPIRY, m.e, token)
    redis.call("DEL", LEASE)
    set_expiries()
  else
    local left = redis.call("PTTL", LEASE)
    redis.call("DEL", LEASE)
    local ended = NOW
    if left > 0 then ended = math.min(NOW, NOW + left - m.dl - 1000) end
    delay_until(ended + m.dl)
    redis.call("PUBLISH", CHANNEL, "p")
  end
end
