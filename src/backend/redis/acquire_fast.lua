-- Runs before the prelude (whose set-up is a good part of a short
-- script's time): the uncontended case, an exclusive lock with no lease,
-- no queue and no lock-delay. Nothing needs pruning and nobody queues, so
-- only the grant itself is written, in short form: the main key and the
-- lease key (see short_lease() in the prelude; no JSON is encoded, which
-- costs more than all the commands here). SET NX fails on a foreign holder
-- of the main key; nothing has been written then, and the full script
-- answers busy. (The holders hash exists only with the expiry set; a stray
-- one, written by hand, goes to the full script too, which checks every
-- key's type.)
-- KEYS and ARGV as in acquire.lua.
do
  local MAIN, HOLDERS, EXPIRY, FENCE, QUEUE, DELAY, LEASE =
    KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8], KEYS[11]
  if ARGV[1] == "l" and ARGV[9] == "x" and ARGV[4] ~= "queued"
      and redis.call("EXISTS", EXPIRY, QUEUE, DELAY, HOLDERS, LEASE) == 0 then
    local t = redis.call("TIME")
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local token = ARGV[6]
    local ttl, max_hold, lock_delay = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
    local e = now + ttl
    if max_hold > 0 and max_hold < ttl then e = now + max_hold end
    -- A write below that fails on a key of another type (written by hand)
    -- is undone with what came before it, and the full script, which checks
    -- every key first, answers: Redis would keep the earlier writes.
    if redis.call("SET", MAIN, token, "NX", "PX", e - now) then
      local fence = redis.pcall("INCR", FENCE)
      if type(fence) == "number"
          and (not KEYS[12] or type(redis.pcall("ZADD", KEYS[12], 0, ARGV[3])) == "number") then
        redis.call("SET", LEASE, token .. " " .. fence .. " " .. t[1] .. " " .. t[2] .. " " ..
          ARGV[10] .. " " .. ARGV[11] .. " " .. ARGV[12] .. " " .. ARGV[17],
          "PX", e + lock_delay + 1000 - now)
        return {1, now, token, fence, 1, now, e}
      end
      redis.call("DEL", MAIN)
    end
  end
end
