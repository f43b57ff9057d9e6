-- Run first by every script, before its fast path: only what the common
-- cases need, so that they pay for neither the prelude's set-up nor keys
-- and arguments they do not read.
--
-- KEYS[1] is the lock's main key, the only key a script is given: its side
-- keys are "{<main>}:<suffix>", in the main key's Cluster slot (the braces
-- are a hash tag), derived here when needed. ARGV[1] is the kind: "l" (a
-- lock or an election) or "s" (a semaphore); the rest is each script's own.
--
-- An exclusive lease lives in the main key alone: "<token> <fence> <since
-- ms> <expires ms> <hold count> <SPEC>", where SPEC is "<ttl ms> <max_hold
-- ms, 0: none> <lock_delay ms> <[owner, sidecar] as JSON>". Its PX runs to
-- the lease's expiry plus its lock-delay: a lease that expires keeps the
-- key, and so the lock, for its lock-delay, and one that is released
-- deletes it. A renewal writes the new expiry into the value too, so that
-- whoever reads the value knows when the lease ends without the clock. A
-- waiter is one entry "<seq> <mode> <token> <since ms> <instance> <SPEC>"
-- of the list "{<main>}:q", in queue order; its token is the one its lease
-- will have, and its instance names the sidecar process that waits (random
-- per process, so that a sidecar restarted under the same id is not taken
-- for the one that queued): its heartbeats and its own channel.

local MAIN = KEYS[1]
local TAG = "{" .. MAIN .. "}:"
local IS_LOCK = ARGV[1] == "l"
-- How long a process's heartbeat keeps its waiters (HEARTBEAT_TTL in
-- redis/mod.rs, which a test keeps equal), and a waiter whose process wrote
-- none yet.
local HEARTBEAT_TTL = 15000

-- The server clock in ms, read by clock() at most once: paths that never
-- look at the time do not pay for TIME.
local NOW = 0
local function clock()
  if NOW == 0 then
    local t = redis.call("TIME")
    NOW = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  return NOW
end

-- The fields of an exclusive lease value, or nil when v is not one (absent,
-- another type, a foreign holder's token, a marker).
local function lease_of(v)
  if type(v) ~= "string" then return nil end
  local token, f, t0, e, c, spec, ttl, mh, dl, who =
    string.match(v, "^(%x+) (%d+) (%d+) (%d+) (%d+) ((%d+) (%d+) (%d+) (.*))$")
  if not token then return nil end
  return {token = token, f = tonumber(f), t0 = tonumber(t0), e = tonumber(e), c = tonumber(c),
          spec = spec, ttl = tonumber(ttl), mh = tonumber(mh), dl = tonumber(dl), who = who}
end

-- The main key's value for a lease.
local function lease_value(token, f, t0, e, c, spec)
  return token .. " " .. f .. " " .. t0 .. " " .. e .. " " .. c .. " " .. spec
end

-- How long a lease granted now runs (its ttl, or less under max_hold).
local function span(ttl, mh)
  if mh > 0 and mh < ttl then return mh end
  return ttl
end

-- The fields of a queue entry, or nil when s is not one.
local function entry_of(s)
  if type(s) ~= "string" then return nil end
  local seq, mode, token, t0, inst, spec, ttl, mh, dl, who =
    string.match(s, "^(%d+) (%a) (%x+) (%d+) (%x+) ((%d+) (%d+) (%d+) (.*))$")
  if not seq then return nil end
  return {seq = seq, m = mode, token = token, t0 = tonumber(t0), inst = inst, spec = spec,
          ttl = tonumber(ttl), mh = tonumber(mh), dl = tonumber(dl), who = who, raw = s}
end

-- Whether the process of queue entry e still heartbeats here: its deadline
-- (`d`, the heartbeat hash's field, nil when it has none) has not passed, or
-- it has none and joined less than a heartbeat's life ago (its first
-- heartbeat may still be on its way; a process that died before sending
-- one is gone after that).
local function beating(e, d)
  d = tonumber(d)
  if d then return d > clock() end
  return e.t0 + HEARTBEAT_TTL > clock()
end

-- With the main key just released (or found free), grants the lock to the
-- first queued exclusive claim whose process is alive, in one step: the
-- main key takes its lease, and "t<seq> <fence> <since> <expiry> <main key>"
-- on that process's own channel (`stem` .. its instance) tells its sidecar,
-- which has the token already. A process is alive when it heartbeats here
-- (`alive`, the caller's own instance, needs no look) and, unless in a
-- Cluster (whose PUBLISH counts only the node's own listeners), someone
-- listens on its channel. Entries of other processes are dropped on the way,
-- and "p" on the lock's channel then tells a live one passed by (its
-- pub/sub connection was down, its heartbeat late) to queue again. `mode`
-- is "1" to hand over, "2" to hand over in a Cluster, "0" to wake the head
-- instead (Redlock, where each node orders its queue its own way), as for a
-- shared or semaphore head: "h<seq> <main key>" on its process's own channel
-- names an exclusive head, "r" on the lock's channel lets every sidecar's
-- head try. Returns true when it granted; the caller frees the main key
-- otherwise.
local function hand_over(mode, alive, stem)
  local direct, counted = mode ~= "0", mode ~= "2"
  local Q = TAG .. "q"
  local dropped = false
  local function done(granted)
    if dropped then redis.call("PUBLISH", TAG .. "wake", "p") end
    return granted
  end
  while true do
    local head = redis.pcall("LPOP", Q)
    if type(head) ~= "string" then return done(false) end
    local e = entry_of(head)
    if e and not (direct and IS_LOCK and e.m == "x") then
      redis.call("LPUSH", Q, head)
      if IS_LOCK and e.m == "x" then
        -- Only its sidecar can let it in: that sidecar alone wakes (on the
        -- lock's channel when nobody listens on its own, e.g. an older one).
        if redis.call("PUBLISH", stem .. e.inst, "h" .. e.seq .. " " .. MAIN) == 0
            or not counted then
          redis.call("PUBLISH", TAG .. "wake", "h" .. e.seq)
        end
      else
        redis.call("PUBLISH", TAG .. "wake", "r")
      end
      return done(false)
    end
    local live = e ~= nil
    if live and e.inst ~= alive then
      live = beating(e, redis.pcall("HGET", TAG .. "heartbeat", e.inst))
    end
    if live then
      local fence = redis.pcall("INCR", TAG .. "fence")
      if type(fence) ~= "number" then
        -- A fence counter written by hand: the full scripts report it.
        redis.call("LPUSH", Q, head)
        redis.call("PUBLISH", TAG .. "wake", "r")
        return done(false)
      end
      clock()
      local len = span(e.ttl, e.mh)
      redis.call("SET", MAIN, lease_value(e.token, fence, NOW, NOW + len, 1, e.spec),
        "PX", len + e.dl)
      if redis.call("PUBLISH", stem .. e.inst, "t" .. e.seq .. " " .. fence .. " " .. NOW .. " " ..
          (NOW + len) .. " " .. MAIN) > 0 or not counted then
        return done(true)
      end
    end
    dropped = dropped or e ~= nil
  end
end
