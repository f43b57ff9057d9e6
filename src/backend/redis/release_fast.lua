-- Runs before the prelude (whose set-up is a good part of a short
-- script's time): with nobody queued, the exclusive holder releasing a lease
-- in short form (acquire_fast.lua), a re-entered hold, or its last hold
-- while nobody else holds (then there is nobody to wake and nothing to
-- prune, and the key goes idle). Otherwise nothing has been written and the
-- full script goes on; the queue is looked at first, so that a contended
-- release pays one call here.
-- KEYS and ARGV as in release.lua.
do
  local MAIN, HOLDERS, EXPIRY, QUEUE, LEASE = KEYS[1], KEYS[2], KEYS[3], KEYS[5], KEYS[11]
  local token = ARGV[4]
  if ARGV[1] == "l" and redis.call("EXISTS", QUEUE) == 0
      and redis.pcall("GET", MAIN) == token then
    local short = redis.pcall("GET", LEASE)
    if type(short) == "string" and string.sub(short, 1, #token + 1) == token .. " " then
      redis.call("DEL", MAIN, LEASE)
      if KEYS[12] then redis.pcall("ZREM", KEYS[12], ARGV[3]) end
      return {0, 0}
    end
    local raw = redis.call("HGET", HOLDERS, token)
    if raw then
      local m = cjson.decode(raw)
      if m.c > 1 then
        m.c = m.c - 1
        redis.call("HSET", HOLDERS, token, cjson.encode(m))
        return {0, m.c}
      end
      -- Holders are a subset of EXPIRY's members: with this lease its only
      -- member, the holder, expiry, limit and heartbeat keys all go.
      if redis.call("ZCARD", EXPIRY) == 1 then
        redis.call("DEL", MAIN, HOLDERS, EXPIRY, KEYS[9], KEYS[7])
        if KEYS[12] then redis.pcall("ZREM", KEYS[12], ARGV[3]) end
        return {0, 0}
      end
    end
  end
end
