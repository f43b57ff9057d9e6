-- The exclusive holder's last hold, before the prelude: the lease goes and,
-- when someone waits, the lock passes to the next exclusive claim in line
-- at once (hand_over.lua). 3 commands inside the script with nobody
-- waiting, 6 or 7 on a handoff. Anything else — a re-entered hold, shared
-- and semaphore leases, a lease that expired into its lock-delay — goes on
-- to the full script, with nothing written here.
-- ARGV as in release.lua.
do
  if IS_LOCK then
    local token = ARGV[2]
    local v = redis.pcall("GET", MAIN)
    if type(v) == "string" then
      -- Only what this needs of the lease (lean.lua): its token, expiry,
      -- hold count and lock-delay; the clock only when a lock-delay makes
      -- the expiry matter.
      local t, e, c, dl = string.match(v, "^(%x+) %d+ %d+ (%d+) (%d+) %d+ %d+ (%d+) ")
      -- A lease in its lock-delay has expired: the full script finds nothing.
      -- (A key without a lock-delay lives no longer than its lease.)
      if t == token and tonumber(c) == 1 and (tonumber(dl) == 0 or tonumber(e) > clock()) then
        if not hand_over(ARGV[3], ARGV[4], ARGV[5], true) then redis.call("DEL", MAIN) end
        -- No holds left: 0, or the grant kept for the caller. (A number or
        -- a string costs Redis less than a table to answer.)
        return KEPT or 0
      end
    end
  end
end
