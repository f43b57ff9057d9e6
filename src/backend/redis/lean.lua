-- Run first by every script, before its fast path: only what the common
-- cases need, so that they pay for neither the prelude's set-up nor keys
-- and arguments they do not read.
--
-- KEYS[1] is the lock's main key, the only key a script reads from KEYS: its
-- side keys are "{<main>}:<suffix>", in the main key's Cluster slot (the
-- braces are a hash tag), derived here when needed. (A Cluster is given
-- them too, so that a master runs no script while it has only part of
-- them: SIDE_KEYS in scripts.rs.) ARGV[1] is the kind: "l" (a
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
-- The last fence (and queue ticket) a counter may reach: 2^53 - 1, the
-- largest integer a Lua number holds exactly. Past it two grants could be
-- told the same fence, so an INCR that goes past it is undone and the full
-- script refuses the key (misfit()).
local LAST_EXACT = 9007199254740991

-- Text that is known to hold digits (what TIME answers, a pattern's %d+
-- capture, a number the sidecar sent) is read with arithmetic, `s + 0`:
-- tonumber(s) converts it twice, and each conversion is a strtod, about
-- 900 instructions. tonumber() stays for text that may not be a number.

-- The server clock in ms, read by clock() at most once: paths that never
-- look at the time do not pay for TIME.
local NOW = 0
local function clock()
  if NOW == 0 then
    local t = redis.call("TIME")
    local us = t[2] + 0
    NOW = t[1] * 1000 + (us - us % 1000) / 1000
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
  return {token = token, f = f + 0, t0 = t0 + 0, e = e + 0, c = c + 0,
          spec = spec, ttl = ttl + 0, mh = mh + 0, dl = dl + 0, who = who}
end
