-- Runs before the prelude: renewing a lease in short form (acquire_fast.lua)
-- keeps that form, so a lock renewed by its watchdog costs no more than one
-- taken and released at once. Otherwise nothing has been written and the
-- full script goes on.
-- KEYS and ARGV as in renew.lua.
do
  local MAIN, LEASE = KEYS[1], KEYS[11]
  if ARGV[1] == "l" and redis.pcall("GET", MAIN) == ARGV[4] then
    local raw = redis.pcall("GET", LEASE)
    if type(raw) == "string" then
      local token, sec, usec, ttl, mh, dl =
        string.match(raw, "^(%x+) %d+ (%d+) (%d+) (%d+) (%d+) (%d+) ")
      if token == ARGV[4] then
        local t = redis.call("TIME")
        local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
        local want = tonumber(ARGV[5])
        if want == 0 then want = tonumber(ttl) end
        local e = now + want
        if tonumber(mh) > 0 then
          local cap = tonumber(sec) * 1000 + math.floor(tonumber(usec) / 1000) + tonumber(mh)
          if e > cap then e = cap end
        end
        redis.call("PEXPIRE", MAIN, math.max(e - now, 1))
        redis.call("PEXPIRE", LEASE, math.max(e - now, 1) + tonumber(dl) + 1000)
        return {now, e}
      end
    end
  end
end
