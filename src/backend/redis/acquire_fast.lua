-- Runs before the prelude (whose set-up is a good part of a short
-- script's time): the uncontended case, an exclusive lock with no lease,
-- no queue and no lock-delay. Nothing needs pruning and nobody queues, so
-- only the grant itself is written. SET NX fails on a foreign holder of the
-- main key; nothing has been written then, and the full script answers busy.
-- KEYS and ARGV as in acquire.lua.
do
  local MAIN, HOLDERS, EXPIRY, FENCE, QUEUE, DELAY = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8]
  if ARGV[1] == "l" and ARGV[9] == "x" and ARGV[4] ~= "queued"
      and redis.call("EXISTS", EXPIRY, QUEUE, DELAY) == 0 then
    local t = redis.call("TIME")
    local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
    local token = ARGV[6]
    local ttl, max_hold, lock_delay = tonumber(ARGV[10]), tonumber(ARGV[11]), tonumber(ARGV[12])
    local e = now + ttl
    if max_hold > 0 and max_hold < ttl then e = now + max_hold end
    if redis.call("SET", MAIN, token, "NX", "PX", e - now) then
      local fence = redis.call("INCR", FENCE)
      local m = {o = ARGV[7], s = ARGV[8], m = "x", f = fence, c = 1, t0 = now,
                 ttl = ttl, cap = 0, dl = lock_delay, e = e}
      if max_hold > 0 then m.cap = now + max_hold end
      redis.call("HSET", HOLDERS, token, cjson.encode(m))
      redis.call("ZADD", EXPIRY, e, token)
      -- As the prelude's set_expiries() with this lease the only one.
      redis.call("PEXPIRE", HOLDERS, e + lock_delay + 1000 - now)
      redis.call("PEXPIRE", EXPIRY, e + lock_delay + 1000 - now)
      if KEYS[11] then redis.call("ZADD", KEYS[11], 0, ARGV[3]) end
      return {1, now, token, fence, 1, now, e}
    end
  end
end
