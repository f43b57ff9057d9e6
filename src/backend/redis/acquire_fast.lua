-- Runs before the prelude (whose set-up is a good part of a short
-- script's time): the uncontended case, an exclusive lock with no lease,
-- no queue and no lock-delay. Nothing needs pruning and nobody queues, so
-- only the grant itself is written. SET NX fails on a foreign holder of the
-- main key; nothing has been written then, and the full script answers busy.
-- (The holders hash exists only with the expiry set; a stray one, written by
-- hand, goes to the full script too, which checks every key's type.)
-- KEYS and ARGV as in acquire.lua.
do
  local MAIN, HOLDERS, EXPIRY, FENCE, QUEUE, DELAY = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8]
  if ARGV[1] == "l" and ARGV[9] == "x" and ARGV[4] ~= "queued"
      and redis.call("EXISTS", EXPIRY, QUEUE, DELAY, HOLDERS) == 0 then
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
      local m = {o = ARGV[7], s = ARGV[8], m = "x", f = fence, c = 1, t0 = now,
                 ttl = ttl, cap = 0, dl = lock_delay, e = e}
      if max_hold > 0 then m.cap = now + max_hold end
      local ok = type(fence) == "number"
      if ok then
        redis.call("HSET", HOLDERS, token, cjson.encode(m))
        redis.call("ZADD", EXPIRY, e, token)
        ok = not KEYS[11] or type(redis.pcall("ZADD", KEYS[11], 0, ARGV[3])) == "number"
        if not ok then
          redis.call("ZREM", EXPIRY, token)
          redis.call("HDEL", HOLDERS, token)
        end
      end
      if ok then
        -- As the prelude's set_expiries() with this lease the only one.
        redis.call("PEXPIRE", HOLDERS, e + lock_delay + 1000 - now)
        redis.call("PEXPIRE", EXPIRY, e + lock_delay + 1000 - now)
        return {1, now, token, fence, 1, now, e}
      end
      redis.call("DEL", MAIN)
    end
  end
end
