-- The queue's helpers, shared by the release's handoff and every script's
-- slow path (after lean.lua and the fast paths, so that a fast path that
-- does not hand over does not create them). See lean.lua for the queue
-- entry's layout.

-- The main key's value for a lease. Numbers are written as integers by
-- one string.format: Lua's own number-to-text conversion goes through
-- printf's "%.14g", several times dearer. (Defined here, after the fast
-- paths, which do without: creating a closure costs every call that runs
-- past its definition.)
local function lease_value(token, f, t0, e, c, spec)
  return string.format("%s %d %d %d %d %s", token, f, t0, e, c, spec)
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
  return {seq = seq, m = mode, token = token, t0 = t0 + 0, inst = inst, spec = spec,
          ttl = ttl + 0, mh = mh + 0, dl = dl + 0, who = who, raw = s}
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
-- head try. With `keep` (a release, whose caller reads its reply) on one
-- Redis, a lock handed to a claim of the caller's own process is published
-- to nobody: the message goes into KEPT, for the reply. (Not in a Cluster,
-- whose client may send a call again after losing its answer: the second
-- run would find the lease handed over and tell nobody.) `first`, when
-- given, is the queue's head, taken from it already, or only read when
-- `read` is set. Returns true when it granted; the caller frees the main
-- key otherwise.
local KEPT
local function hand_over(mode, alive, stem, keep, first, read)
  local direct, counted = mode ~= "0", mode ~= "2"
  local Q = TAG .. "q"
  local dropped, granted = false, false
  while true do
    local head = first or redis.pcall("LPOP", Q)
    local taken = not (first and read)
    first = nil
    if type(head) ~= "string" then break end
    local e = entry_of(head)
    if e and not (direct and IS_LOCK and e.m == "x") then
      -- Put back: a queue its only entry left and came back to is a new
      -- key, without the expiry heartbeats keep (as a join's first entry).
      if taken and redis.call("LPUSH", Q, head) == 1 then
        redis.call("PEXPIRE", Q, HEARTBEAT_TTL)
      end
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
      break
    end
    -- Passed by: out of the queue, if only read.
    if not taken then redis.call("LPOP", Q) end
    local live = e ~= nil
    if live and e.inst ~= alive then
      live = beating(e, redis.pcall("HGET", TAG .. "heartbeat", e.inst))
    end
    if live then
      local fence = redis.pcall("INCR", TAG .. "fence")
      if type(fence) == "number" and (fence < 1 or fence > LAST_EXACT) then
        redis.call("DECR", TAG .. "fence")
        fence = nil
      end
      if type(fence) ~= "number" then
        -- A fence counter written by hand: the full scripts report it.
        if redis.call("LPUSH", Q, head) == 1 then redis.call("PEXPIRE", Q, HEARTBEAT_TTL) end
        redis.call("PUBLISH", TAG .. "wake", "r")
        break
      end
      clock()
      local len = span(e.ttl, e.mh)
      redis.call("SET", MAIN, lease_value(e.token, fence, NOW, NOW + len, 1, e.spec),
        "PX", string.format("%d", len + e.dl))
      local told = string.format("t%s %d %d %d %s", e.seq, fence, NOW, NOW + len, MAIN)
      if keep and mode == "1" and e.inst == alive then
        -- The caller's own claim: its sidecar reads the grant in the reply
        -- (and, should the reply be lost, has its head look again).
        KEPT = told
        granted = true
        break
      end
      if redis.call("PUBLISH", stem .. e.inst, told) > 0 or not counted then
        granted = true
        break
      end
    end
    dropped = dropped or e ~= nil
  end
  if dropped then redis.call("PUBLISH", TAG .. "wake", "p") end
  return granted
end
