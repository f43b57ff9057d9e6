-- The full bookkeeping, shared by every script's slow path (after lean.lua
-- and the script's fast path). A lock's keys all carry the hash tag
-- {<main>}, so they share a Cluster slot and each script is atomic on one node:
--
--   <main>            string: an exclusive lease (lean.lua), SHARED while
--                     shared holders exist, DELAYED during a lock-delay no
--                     lease covers, or anything a foreign client wrote
--   {<main>}:fence    counter of fences, never expires
--   {<main>}:seq      counter of queue tickets, never expires
--   {<main>}:q        list of queued claims (lean.lua), in queue order
--   {<main>}:heartbeat hash: sidecar process (instance) -> deadline ms of its
--                     waiters here, so that keeping waiters alive costs the
--                     same for one waiter as for thousands
--   {<main>}:holders  hash: token -> JSON meta of a shared or semaphore lease
--   {<main>}:expiry   sorted set: token -> expiry ms of those leases
--   {<main>}:delay    a semaphore's (or a shared lock's) lock-delay end, PX
--   {<main>}:limit    a semaphore's permits while in use
--   {<main>}:forced   hash: token -> 1 of leases a force-release removed,
--                     until a minute past the last one's expiry

local SHARED = "sidelock:shared"
local DELAYED = "sidelock:delayed"
local FENCE, SEQ, QUEUE, BEAT, HOLDERS, EXPIRY, DELAY, LIMIT, FORCED =
  TAG .. "fence", TAG .. "seq", TAG .. "q", TAG .. "heartbeat", TAG .. "holders",
  TAG .. "expiry", TAG .. "delay", TAG .. "limit", TAG .. "forced"

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
-- equals no lease and no marker, so it is a foreign holder like a legacy
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

local function main_set(v, px)
  redis.call("SET", MAIN, v, "PX", math.max(px, 1))
  MAIN_V = v
end

local function main_del()
  redis.call("DEL", MAIN)
  MAIN_V = false
end

-- Redis does not undo a script's writes when a later command fails, so a
-- script that writes checks first that every key it may write is absent or
-- of the type sidelock writes there (and that counters are numbers): the
-- first key that is not, and what it is; nil when all fit. The main key is
-- not checked: any type there is a foreign holder (main_get).
-- Counters (fence, seq) are numbers INCR takes (no sign, no leading zero),
-- at most LAST_EXACT (a Lua number holds them exactly) and, where the
-- script may count (`counting`), below it, so that the next INCR stays
-- exact: a lock whose counter is spent can still be inspected, scanned and
-- released. The other numbers are
-- integers (in any form Redis may have written a Lua number in: some 7.2
-- releases wrote 100000000 as 1e+8).
local function misfit(counting)
  local want = {{FENCE, "counter"}, {SEQ, "counter"}, {QUEUE, "list"}, {BEAT, "hash"},
                {HOLDERS, "hash"}, {EXPIRY, "zset"}, {DELAY, "number"}, {LIMIT, "number"}}
  for _, w in ipairs(want) do
    local found = redis.call("TYPE", w[1]).ok
    if found ~= "none" then
      if w[2] == "counter" or w[2] == "number" then
        if found ~= "string" then return w[1], found end
        local v = redis.call("GET", w[1])
        if w[2] == "counter" then
          if v ~= "0" and not string.match(v, "^[1-9]%d*$") then
            return w[1], "string that is not a counter (digits without a leading zero)"
          end
          local n = tonumber(v)
          if n > LAST_EXACT or (counting and n >= LAST_EXACT) then
            return w[1], "counter at 2^53 - 1 or above (fences past it would not be exact)"
          end
        else
          local n = tonumber(v)
          if not n or n ~= math.floor(n) or n == math.huge or n == -math.huge then
            return w[1], "string that is not an integer"
          end
        end
      elseif found ~= w[2] then
        return w[1], found
      end
    end
  end
  return nil
end

-- The exclusive lease in the main key as holder meta (see holders()), with
-- its expiry e; nil when the main key holds none. A lease past its expiry
-- (in its lock-delay) holds nothing: `delayed` is then when the key frees.
local X, X_DELAY
local function xlease()
  if X == nil then
    X, X_DELAY = false, 0
    local l = lease_of(main_get())
    if l then
      clock()
      if l.e > NOW then
        local o, s = unpack(cjson.decode(l.who))
        X = {token = l.token, o = o, s = s, m = "x", f = l.f, c = l.c, t0 = l.t0, ttl = l.ttl,
             cap = 0, dl = l.dl, spec = l.spec, who = l.who, e = l.e}
        if l.mh > 0 then X.cap = l.t0 + l.mh end
      else
        X_DELAY = l.e + l.dl
      end
    end
  end
  return X, X_DELAY
end

-- Writes the exclusive lease m to the main key, expiring at m.e plus its
-- lock-delay.
local function xlease_put(m)
  main_set(lease_value(m.token, m.f, m.t0, m.e, m.c, m.spec), m.e - NOW + m.dl)
  X = m
end

-- Shared and semaphore leases: the holders hash, decoded once.
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

-- Nothing is granted before `ms`. A lock's delay lives in its main key (so
-- that the short paths, which look at nothing else, see it): the lease in
-- it keeps it, or the DELAYED marker does; while shared holders keep the
-- key SHARED, the delay key holds it until sync_shared() moves it there.
local function delay_until(ms)
  if ms <= NOW then return end
  if IS_LOCK then
    local main = main_get()
    local l = lease_of(main)
    if main == false then
      main_set(DELAYED, ms - NOW)
      return
    elseif main == DELAYED or (l and l.e <= NOW) then
      -- The marker, or a lease that ended and keeps the key for its own
      -- lock-delay: the key stays until the later end. (A live lease's key
      -- must end with it, so that its renewals and release judge it right:
      -- its delay waits in the delay key.)
      if redis.call("PTTL", MAIN) < ms - NOW then redis.call("PEXPIRE", MAIN, ms - NOW) end
      return
    elseif main ~= SHARED and not l then
      return
    end
  end
  local cur = tonumber(redis.call("GET", DELAY) or "0")
  -- As text: a number would be formatted by "%.17g" (or, by some 7.2
  -- releases, as 1e+8).
  if ms > cur then
    redis.call("SET", DELAY, string.format("%d", ms), "PX", string.format("%d", ms - NOW))
  end
end

-- When the delay key's delay ends (0: none).
local function delay_end()
  local left = redis.call("PTTL", DELAY)
  if left > 0 then return NOW + left end
  return 0
end

local function drop_shared(token)
  del_holder(token)
  redis.call("ZREM", EXPIRY, token)
end

-- The main key mirrors shared holders: SHARED, expiring with the last of
-- them; when the last goes, a lock-delay still running takes the key over.
local function sync_shared()
  if not IS_LOCK then return end
  local main = main_get()
  if main and main ~= SHARED then return end
  local last = redis.call("ZRANGE", EXPIRY, -1, -1, "WITHSCORES")
  if #last > 0 and tonumber(last[2]) > NOW then
    main_set(SHARED, tonumber(last[2]) - NOW)
    return
  end
  local until_ms = delay_end()
  if until_ms > NOW then
    main_set(DELAYED, until_ms - NOW)
  elseif main then
    main_del()
  end
end

-- The earliest heartbeat deadline of a sidecar with waiters here.
local function first_lapse()
  local first = 0
  for _, d in pairs(beats()) do
    if first == 0 or d < first then first = d end
  end
  return first
end

-- Queued claims, decoded (entry_of), in queue order.
local function queue()
  local out = {}
  for _, s in ipairs(redis.call("LRANGE", QUEUE, 0, -1)) do
    local e = entry_of(s)
    if e then out[#out + 1] = e end
  end
  return out
end

-- Empty lists, sets and hashes do not exist in Redis.
local function idle()
  if redis.call("EXISTS", EXPIRY, QUEUE) > 0 then return false end
  return not (IS_LOCK and xlease())
end

-- What an idle key no longer needs: its limit and heartbeats.
local function tidy_if_idle()
  if idle() then
    redis.call("DEL", LIMIT, BEAT)
    if B then B = {} end
  end
end

-- Drops shared and semaphore leases past their expiry (starting their
-- lock-delay), waiters whose sidecar stopped heartbeating, and what heads the
-- queue without being a queue entry (written by hand). Publishes if anything
-- went. (An exclusive lease goes by itself: its main key expires.)
local function prune()
  local changed = false
  while true do
    local head = redis.call("LINDEX", QUEUE, 0)
    if not head or entry_of(head) then break end
    redis.call("LPOP", QUEUE)
    changed = true
  end
  for _, token in ipairs(redis.call("ZRANGEBYSCORE", EXPIRY, "-inf", NOW)) do
    local m = meta_of(token)
    if m then delay_until(m.e + m.dl) end
    drop_shared(token)
    changed = true
  end
  local lapsed = {}
  local b = beats()
  for inst, d in pairs(b) do
    if d <= NOW then lapsed[inst] = true end
  end
  for inst in pairs(lapsed) do
    redis.call("HDEL", BEAT, inst)
    b[inst] = nil
  end
  -- Every waiter's process still heartbeats: the queue is long, and this
  -- runs in many scripts, so it is read only when the head's looks late or
  -- a process lapsed.
  local head = entry_of(redis.call("LINDEX", QUEUE, 0))
  if next(lapsed) or (head and not beating(head, b[head.inst])) then
    for _, s in ipairs(redis.call("LRANGE", QUEUE, 0, -1)) do
      local e = entry_of(s)
      if (not e) or lapsed[e.inst] or not beating(e, b[e.inst]) then
        redis.call("LREM", QUEUE, 1, s)
        changed = true
      end
    end
  end
  if changed then
    sync_shared()
    redis.call("PUBLISH", TAG .. "wake", "p")
  end
  return changed
end

-- Side keys expire with what they describe, so a lock every sidecar
-- abandoned disappears by itself: holder keys with the last shared lease,
-- queue keys with the last heartbeat. The fence and ticket counters never
-- expire. Only what this run wrote moves a deadline (removals leave the
-- keys' expiry at most later than needed), so only that is reset.
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
      for _, k in ipairs({QUEUE, BEAT}) do redis.call("PEXPIRE", k, latest - NOW) end
    end
  end
end

-- One holder as replies carry it: {[owner, sidecar] as JSON, mode, fence,
-- hold count, since, expires}.
local function holder_row(who, m)
  return {who, m.m, m.f, m.c, m.t0, m.e}
end

-- Every holder: the exclusive lease, shared or semaphore leases, and a
-- foreign holder of the main key (a legacy SET NX PX client; its own
-- expiry, 0 when it has none).
local function holder_rows()
  local list = {}
  if IS_LOCK then
    local x = xlease()
    if x then list[#list + 1] = holder_row(x.who, x) end
  end
  local h, keys = holders()
  for _, token in ipairs(keys) do
    local m = h[token]
    if not IS_LOCK or m.m == "s" then list[#list + 1] = holder_row(cjson.encode({m.o, m.s}), m) end
  end
  if IS_LOCK then
    local main = main_get()
    if main and main ~= SHARED and main ~= DELAYED and not lease_of(main) then
      local pttl = redis.call("PTTL", MAIN)
      local e = 0
      if pttl > 0 then e = NOW + pttl end
      list[#list + 1] = {'["(foreign)",""]', "x", 0, 1, 0, e}
    end
  end
  return list
end
