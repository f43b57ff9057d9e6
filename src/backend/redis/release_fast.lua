-- The exclusive holder's last hold, before the prelude: the lease goes and,
-- when someone waits, the lock passes to the next exclusive claim in line
-- at once (lean.lua's hand_over). 3 commands inside the script with nobody
-- waiting, 6 or 7 on a handoff. Anything else — a re-entered hold, shared
-- and semaphore leases, a lease that expired into its lock-delay — goes on
-- to the full script, with nothing written here.
-- ARGV as in release.lua.
do
  if IS_LOCK then
    local token = ARGV[2]
    local v = redis.pcall("GET", MAIN)
    if type(v) == "string" and string.sub(v, 1, #token + 1) == token .. " " then
      local l = lease_of(v)
      -- A lease in its lock-delay has expired: the full script finds nothing.
      -- (A key without a lock-delay lives no longer than its lease.)
      if l and l.c == 1 and (l.dl == 0 or l.e > clock()) then
        if not hand_over(ARGV[3], ARGV[4], ARGV[5]) then redis.call("DEL", MAIN) end
        return {0, 0}
      end
    end
  end
end
