-- The exclusive holder's last hold, before the queue's helpers and the
-- prelude: the lease goes (3 commands inside the script) when nobody waits.
-- When someone does, the head of the queue is taken here and the lock
-- passes to the next exclusive claim in line from it at once, in
-- release_handing.lua after hand_over.lua (6 or 7 commands in all); on
-- Redlock, whose nodes only wake the head, the head is read and stays in
-- line (4: the lease, the head, the wake, the delete). The helpers'
-- closures are created only for a handoff. Anything else — a
-- re-entered hold, shared and semaphore leases, a lease that expired into
-- its lock-delay — goes on to the full script, with nothing written here.
-- ARGV as in release.lua.
local RELEASE_HEAD, RELEASE_HEAD_READ
do
  if IS_LOCK then
    local token = ARGV[2]
    local v = redis.pcall("GET", MAIN)
    if type(v) == "string" then
      -- Only what this needs of the lease (lean.lua): its token, expiry,
      -- hold count and lock-delay; the clock only when a lock-delay makes
      -- the expiry matter. The common lease (one hold, no lock-delay) is
      -- matched with those two as text first, which reads no number (each
      -- costs a strtod). A lease in its lock-delay has expired: the full
      -- script finds nothing. (A key without a lock-delay lives no longer
      -- than its lease.)
      local mine = string.match(v, "^(%x+) %d+ %d+ %d+ 1 %d+ %d+ 0 ") == token
      if not mine then
        local t, e, c, dl = string.match(v, "^(%x+) %d+ %d+ (%d+) (%d+) %d+ %d+ (%d+) ")
        mine = t == token and c + 0 == 1 and (dl + 0 == 0 or e + 0 > clock())
      end
      if mine then
        -- Where the head only wakes (Redlock), it stays in the queue: read,
        -- not taken and put back.
        local head
        if ARGV[3] ~= "0" then
          head = redis.pcall("LPOP", TAG .. "q")
        else
          head = redis.pcall("LINDEX", TAG .. "q", "0")
          RELEASE_HEAD_READ = true
        end
        if type(head) ~= "string" then
          redis.call("DEL", MAIN)
          -- No holds left. (A number costs Redis less than a table to answer.)
          return 0
        end
        RELEASE_HEAD = head
      end
    end
  end
end
