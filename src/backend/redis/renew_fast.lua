-- Renewing an exclusive lease, before the prelude: its main key takes the
-- new expiry (3 commands inside the script). Anything else goes on to the full
-- script, with nothing written here.
-- ARGV as in renew.lua.
do
  if IS_LOCK then
    local token = ARGV[2]
    local v = redis.pcall("GET", MAIN)
    if type(v) == "string" and string.sub(v, 1, #token + 1) == token .. " " then
      local l = lease_of(v)
      if l and l.e > clock() then
        local want = tonumber(ARGV[3])
        if want == 0 then want = l.ttl end
        local e = NOW + want
        if l.mh > 0 and e > l.t0 + l.mh then e = l.t0 + l.mh end
        -- Past its max_hold, it ends now.
        local kept = math.max(e, NOW + 1)
        redis.call("SET", MAIN, lease_value(l.token, l.f, l.t0, kept, l.c, l.spec),
          "PX", kept - NOW + l.dl)
        return {NOW, e}
      end
    end
  end
end
